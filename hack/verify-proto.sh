#!/usr/bin/env bash
# Fails (exit 1) when driver/kubelet/api is not exactly what hack/gen-proto.sh generates from
# proto/: someone edited a .proto without regenerating, or edited generated code by hand.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$ROOT/hack/gen-proto.sh" --out "$WORK/api" >/dev/null

if ! diff -r -u -x __pycache__ "$WORK/api" "$ROOT/driver/kubelet/api"; then
  echo >&2
  echo "error: driver/kubelet/api is stale or hand-edited; run hack/gen-proto.sh and commit the result" >&2
  echo "(generated with grpcio-tools $("${PYTHON:-$ROOT/.venv/bin/python}" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || echo '?'))" >&2
  exit 1
fi
echo "driver/kubelet/api is up to date"
