#!/usr/bin/env bash
# Install Debian's redis-server: a real redis-server for the replica tests (tests/remote/test_shared_state.py, tests/e2e/test_replicas.py): the tests start their own on a free loopback port, never the system service.
# Idempotent: returns at once when `redis-server` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: those tests then fail under CI=true and skip locally.
# The package's own service is not started (policy-rc.d refuses it during the install).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "$0")/lib/apt.sh"
apt_install setup-redis redis-server
command -v redis-server >/dev/null 2>&1 && echo "setup-redis: $(command -v redis-server)" || true
