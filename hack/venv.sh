#!/usr/bin/env bash
# Creates (or reuses) the project virtual environment .venv and installs Tandem with its test
# extras into it. Run by hack/demo.sh and hack/test.sh so that both work on a fresh machine.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "Tandem needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x "$repo/.venv/bin/python" ]; then
  "$python" -m venv "$repo/.venv"
fi
stamp="$repo/.venv/.tandem-installed"
extras="${TANDEM_EXTRAS:-test}"
# Reinstall only when the project metadata changed, so repeated runs start fast.
want="$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)-$extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$repo/.venv/bin/python" -m pip install -q --upgrade pip >/dev/null
  "$repo/.venv/bin/python" -m pip install -q -e "${repo}[${extras}]"
  echo "$want" >"$stamp"
fi
