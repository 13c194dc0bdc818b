#!/usr/bin/env bash
# Set up and run the appliance on this machine: the embedded Auth Service + Memory Guard (Unix
# socket $UOMP_HOME/guard.sock, Local Profile on 127.0.0.1:9374) and the mTLS gateway on
# 127.0.0.1:9443. Creates the data directory, keys and CA on first run. Extra arguments go to
# `uomp gateway start` (see `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/uomp gateway start "$@"
