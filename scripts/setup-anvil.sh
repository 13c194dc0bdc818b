#!/usr/bin/env bash
# Install the anchoring tools into anchor-tools/node_modules (gitignored), pinned by
# anchor-tools/package-lock.json: the npm package @foundry-rs/anvil-linux-amd64, which ships the
# anvil binary (a real local EVM chain for tests/anchor/test_anchor_evm.py; nothing is downloaded at run
# time), and solc-js (scripts/build-contract.sh). Idempotent: when node_modules already matches the
# lock file it returns at once. Without node and npm it says so and exits 0 (the chain tests then
# skip with the same reason). On a platform other than linux-x64 npm skips the anvil package (it is
# an optional dependency) and the chain tests skip.
set -euo pipefail
cd "$(dirname "$0")/../anchor-tools"
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "setup-anvil: node and npm not found; anvil and solc not installed" >&2
  exit 0
fi
stamp=node_modules/.uomp-installed-lock
if [ -f node_modules/solc/package.json ] && cmp -s package-lock.json "$stamp"; then
  exit 0
fi
npm ci --no-audit --no-fund --loglevel=error
cp package-lock.json "$stamp"
