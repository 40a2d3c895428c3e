#!/usr/bin/env bash
# The full test suite, exactly as CI runs it. As root it also installs the Debian packages that
# the network-namespace and container-runtime tests need (iproute2, podman, runc, busybox-static);
# without root those tests skip and say why.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=()
  command -v ip >/dev/null || need+=(iproute2)
  command -v podman >/dev/null || need+=(podman)
  [ -x /usr/sbin/runc ] || need+=(runc)
  [ -x /bin/busybox ] || need+=(busybox-static)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
fi
TANDEM_EXTRAS=test hack/venv.sh
export PATH="$repo/.venv/bin:$PATH"
hack/verify-proto.sh
ruff check .
lint-imports
exec python -m pytest -q "$@"
