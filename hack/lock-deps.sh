#!/usr/bin/env bash
# Regenerates the hash-pinned lock files the Dockerfile installs from:
#   requirements.lock        the runtime dependencies of [project].dependencies in pyproject.toml
#   requirements-build.lock  the build backend of [build-system].requires (setuptools, wheel)
# pip-tools runs in a throwaway virtual environment, so .venv is never touched. The locks are
# resolved for CPython 3.11 (the image's Python); --generate-hashes records the hashes of every
# file PyPI has for each pinned version, so one lock serves amd64 and arm64 images alike.
# Usage: hack/lock-deps.sh            (rewrites both files; commit the result)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "lock-deps.sh: run with Python 3.11 (the image's Python); set PYTHON=/path/to/python3.11" >&2
  exit 1
}
# Ignore machine-local pip configuration (extra indexes, find-links, constraints): the lock must
# come out the same on every machine, from PyPI alone.
export PIP_CONFIG_FILE=/dev/null
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "pip-tools==7.6.2"
compile=("$work/venv/bin/pip-compile" --quiet --strip-extras --generate-hashes --allow-unsafe --no-emit-index-url --no-emit-find-links)
cd "$repo"
# Runtime: only [project].dependencies (no extras), so test tools never reach the image.
CUSTOM_COMPILE_COMMAND="hack/lock-deps.sh" "${compile[@]}" --output-file requirements.lock pyproject.toml
# Build: the [build-system] requirements alone, for `pip wheel --no-build-isolation` in the builder.
sed -n '/^\[build-system\]/,/^\[/p' pyproject.toml | grep -o '"[^"]*"' | tr -d '"' \
  | grep -v '^setuptools.build_meta$' >"$work/build.in"
CUSTOM_COMPILE_COMMAND="hack/lock-deps.sh" "${compile[@]}" --output-file requirements-build.lock "$work/build.in"
sed -i "s|$work/build.in|pyproject.toml [build-system].requires|" requirements-build.lock
echo "wrote requirements.lock and requirements-build.lock"
