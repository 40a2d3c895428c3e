#!/usr/bin/env bash
# GPU smoke test for a machine with a real NVIDIA GPU: prints what Tandem would publish for it as
# ResourceSlice YAML (real NVML through pynvml, real sysfs and netlink). Exit 1 if nothing is found.
# Uses the project virtual environment when there is one, else the system Python with the
# packages it needs (nvidia-ml-py, pyroute2, PyYAML) already installed: it runs discovery and slice
# building only, which never talk to an API server, so no Kubernetes client is needed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
[ -x "$repo/.venv/bin/python" ] && python="$repo/.venv/bin/python"
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "# nvidia-smi not found" >&2
cd "$repo"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" hack/gpu_smoke.py "$@"
