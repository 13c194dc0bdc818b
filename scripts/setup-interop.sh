#!/usr/bin/env bash
# Install the Node.js interop harness (interop/: the npm `jose` library, pinned by
# interop/package-lock.json) used by tests/client/test_interop_ts.py. Idempotent: when interop/node_modules
# already matches the lock file it returns at once. Without node and npm it says so and exits 0
# (the interop tests then skip with the same reason).
set -euo pipefail
cd "$(dirname "$0")/../interop"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "setup-interop: node and npm not found; interop harness not installed" >&2
  exit 0
fi
stamp=node_modules/.uomp-installed-lock
if [ -f node_modules/jose/package.json ] && cmp -s package-lock.json "$stamp"; then
  exit 0
fi
npm ci --no-audit --no-fund --loglevel=error
cp package-lock.json "$stamp"
