#!/usr/bin/env bash
# Install Debian's redis-server: a real redis-server for the replica tests (tests/remote/test_shared_state.py, tests/e2e/test_replicas.py): the tests start their own on a free loopback port, never the system service.
# Idempotent: returns at once when `redis-server` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: those tests then fail under CI=true and skip locally.
# The package's own service is not started (policy-rc.d refuses it during the install).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-redis: apt-get not found; redis-server not installed" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-redis: not root; install redis-server yourself (apt-get install redis-server)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ "$made_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }
echo "setup-redis: $(command -v redis-server)"
