# The reader of components.conf, where every component's flags, the feature gates and the ports
# are written once; sourced by lib.sh before anything that uses them.
# shellcheck shell=bash

: "${here:?}"
SETTINGS="$here/components.conf"
# A profile adds its own lines to the common ones (components.conf says how): the scale bench runs
# the launcher with TANDEM_CLUSTER_PROFILE=scale.
PROFILE="${TANDEM_CLUSTER_PROFILE:-}"

# settings SCOPE: the "KEY [VALUE]" lines of SCOPE, the common ones first, then the profile's.
settings() {
  awk -v scope="$1" -v qualified="$PROFILE:$1" '
    /^[[:space:]]*(#|$)/ {next}
    $1 == scope {print $2, $3}
    $1 == qualified {extra[++n] = $2 " " $3}
    END {for (i = 1; i <= n; i++) print extra[i]}
  ' "$SETTINGS"
}

# load_settings: the ports into their variables (a later line wins) and FEATURE_GATES, as the
# components' flags take them.
load_settings() {
  local key value
  while read -r key value; do
    [[ "$key" =~ ^[A-Z_]+_PORT$ && "$value" =~ ^[0-9]+$ ]] || { echo "components.conf: bad port $key $value" >&2; return 1; }
    printf -v "$key" %s "$value"
  done < <(settings ports)
  # shellcheck disable=SC2034 # components.conf's values and components.sh use it
  FEATURE_GATES="$(settings feature-gates | awk '{printf "%s%s=%s", (NR > 1 ? "," : ""), $1, $2}')"
}

# command_line NAME: CMD, the command that starts component NAME: its binary in $BIN and its
# flags from components.conf, each @VAR@ in a value replaced by the variable VAR (unset is an error).
command_line() {
  local flag value var
  CMD=("$BIN/$1")
  while read -r flag value; do
    while [[ "$value" =~ @([A-Za-z_]+)@ ]]; do
      var="${BASH_REMATCH[1]}"
      value="${value//@"$var"@/${!var}}"
    done
    CMD+=("$flag")
    [ -z "$value" ] || CMD+=("$value")
  done < <(settings "$1")
  [ "${#CMD[@]}" -gt 1 ] || { echo "components.conf: no flags for $1" >&2; return 1; }
}
