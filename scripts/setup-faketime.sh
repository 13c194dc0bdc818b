#!/usr/bin/env bash
# Install Debian's libfaketime (faketime, libfaketime.so.1) for the clock tests: a real guard process
# whose wall clock the test steps back and forward mid-run (tests/ledger/test_audit_clock.py).
# Idempotent: returns at once when `faketime` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: the clock tests then fail under CI=true and skip locally.
set -euo pipefail
if command -v faketime >/dev/null 2>&1; then
  exit 0
fi
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "$0")/lib/apt.sh"
apt_install setup-faketime faketime
command -v faketime >/dev/null 2>&1 && echo "setup-faketime: $(command -v faketime)" || true
