#!/usr/bin/env bash
# The whole driver on this machine: simulated cluster, simulated GPU/NIC node, real daemon.
# Needs no cluster, no GPU, no NIC and no root.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TANDEM_EXTRAS="test" "$repo/hack/venv.sh"
exec "$repo/.venv/bin/tandem-driver" demo "$@"
