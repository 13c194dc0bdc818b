#!/usr/bin/env bash
# Install Debian's haproxy: haproxy (TCP mode) in front of two gateway processes in the replica tests (tests/e2e/test_replicas.py); the tests run their own, never the system service.
# Idempotent: returns at once when `haproxy` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: those tests then fail under CI=true and skip locally.
# The package's own service is not started (policy-rc.d refuses it during the install).
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "$0")/lib/apt.sh"
apt_install setup-haproxy haproxy
command -v haproxy >/dev/null 2>&1 && echo "setup-haproxy: $(command -v haproxy)" || true
