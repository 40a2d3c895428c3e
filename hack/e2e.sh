#!/usr/bin/env bash
# The real-cluster suite on its own: brings the cluster up (building it the first time, about 15
# minutes on 2 cores), runs tests/cluster against it, and takes it down again unless KEEP=1.
# With --nodes 3 (first), a three-node cluster and the three-node suite, tests/cluster/multi.
# Needs root and Go; extra arguments go to pytest (hack/e2e.sh -k health).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ "$(id -u)" != 0 ]; then
  echo "hack/e2e.sh needs root: it runs a kubelet, containerd and kube-proxy on this machine" >&2
  exit 2
fi
command -v go >/dev/null || { echo "hack/e2e.sh needs Go to build the cluster (https://go.dev/dl/)" >&2; exit 2; }
nodes=1
if [ "${1:-}" = --nodes ]; then
  nodes="${2:?--nodes needs a number}"
  shift 2
fi
suite=(tests/cluster --ignore=tests/cluster/multi)
[ "$nodes" = 1 ] || suite=(tests/cluster/multi)
TANDEM_EXTRAS="test" hack/venv.sh
rc=0
if hack/cluster.sh up --nodes "$nodes"; then
  TANDEM_E2E=1 TANDEM_E2E_NODES="$nodes" .venv/bin/python -m pytest -q "${suite[@]}" "$@" || rc=$?
else
  rc=1 # and what it did start is taken down below, like a cluster that came up
fi
if [ "${KEEP:-0}" != 1 ]; then
  # Taking the cluster down is part of the test: it must leave no process, mount or state behind.
  hack/cluster.sh down || { echo "hack/cluster.sh down failed" >&2; rc=1; }
fi
exit "$rc"
