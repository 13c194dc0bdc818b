#!/usr/bin/env bash
# Install Debian's libfaketime (faketime, libfaketime.so.1) for the clock tests: a real guard process
# whose wall clock the test steps back and forward mid-run (tests/ledger/test_audit_clock.py).
# Idempotent: returns at once when `faketime` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: the clock tests then fail under CI=true and skip locally.
set -euo pipefail
if command -v faketime >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-faketime: apt-get not found; faketime not installed" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-faketime: not root; install faketime yourself (apt-get install faketime)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends faketime >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends faketime >/dev/null; }
echo "setup-faketime: $(command -v faketime)"
