#!/usr/bin/env bash
# Prints the path of a helm binary built from its Go module at the version hack/helm/go.mod pins,
# building it the first time (a few minutes on 2 cores). Cached like the cluster's binaries, under
# a key of its own, so pinning helm never invalidates the cluster's 30-minute build:
# ~/.cache/tandem-cluster/helm-<key>/bin/helm (TANDEM_CLUSTER_CACHE moves the cache root).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/helm" && pwd)"
cache_root="${TANDEM_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem-cluster}"

command -v go >/dev/null || { echo "hack/helm.sh needs Go to build helm (https://go.dev/dl/)" >&2; exit 2; }

build_helm() {
  (cd "$here" && CGO_ENABLED=0 GOBIN="$1" GOFLAGS=-mod=readonly go install -trimpath -ldflags "-s -w" tool)
}

# The key covers what decides the binary: the pinned versions, the toolchain and the build flags.
key="$({
  cat "$here/go.mod" "$here/go.sum"
  go version
  declare -f build_helm
} | sha256sum | cut -c1-16)"
bin="$cache_root/helm-$key/bin"

if [ ! -f "$bin/.complete" ]; then
  mkdir -p "$bin"
  # One build at a time: tests running side by side share the cache.
  exec 9>"$bin/.lock"
  flock 9
  if [ ! -f "$bin/.complete" ]; then
    echo "building helm $(awk '$1 == "helm.sh/helm/v3" {print $2}' "$here/go.mod") (first time only)" >&2
    build_helm "$bin"
    touch "$bin/.complete"
  fi
fi
echo "$bin/helm"
