#!/usr/bin/env bash
# The full test suite, exactly as CI runs it. As root it also installs the Debian packages that
# the network-namespace and container-runtime tests need (iproute2, podman, runc, busybox-static).
# As root with Go it brings up the real Kubernetes cluster of hack/cluster.sh (building it the
# first time) and the same pytest run ends with the real-cluster suite, tests/cluster; it takes
# the cluster down afterwards, then runs the three-node suite (tests/cluster/multi) on a three-node
# cluster of its own (hack/e2e.sh --nodes 3). Without root those tests skip and say why.
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
TANDEM_EXTRAS="test" hack/venv.sh
export PATH="$repo/.venv/bin:$PATH"
hack/verify-proto.sh
ruff check .
ruff format --check .
lint-imports
python hack/shellcheck_all.py  # every tracked shell script
mypy  # strict, on driver/, cdi/ and hack/ ([tool.mypy] in pyproject.toml)
if [ "$(id -u)" = 0 ] && command -v go >/dev/null && [ "${TANDEM_E2E:-1}" != 0 ]; then
  # A cluster that fails to come up fails the cluster tests (with its log), not the others.
  hack/cluster.sh up || echo "hack/cluster.sh up failed: the tests in tests/cluster will fail" >&2
  export TANDEM_E2E=1
else
  echo "tests/cluster (the real Kubernetes cluster) skipped: it needs root and Go; hack/e2e.sh runs it" >&2
  export TANDEM_E2E=0
fi
rc=0
python -m pytest -q --ignore=tests/cluster/multi "$@" || rc=$?
if [ "$TANDEM_E2E" = 1 ]; then
  # Taking the cluster down is part of the test: it must leave no process, mount or state behind.
  hack/cluster.sh down || { echo "hack/cluster.sh down failed" >&2; rc=1; }
  # pytest's 5 is "no test selected": arguments such as -k that pick none of the three-node tests.
  hack/e2e.sh --nodes 3 "$@" || { multi=$?; [ "$multi" = 5 ] || rc="$multi"; }
fi
exit "$rc"
