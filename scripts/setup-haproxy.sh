#!/usr/bin/env bash
# Install Debian's haproxy: haproxy (TCP mode) in front of two gateway processes in the replica tests (tests/e2e/test_replicas.py); the tests run their own, never the system service.
# Idempotent: returns at once when `haproxy` is there. Without apt-get (not Debian/Ubuntu) or
# without root it says so and exits 0: those tests then fail under CI=true and skip locally.
# The package's own service is not started (policy-rc.d refuses it during the install).
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-haproxy: apt-get not found; haproxy not installed" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "setup-haproxy: not root; install haproxy yourself (apt-get install haproxy)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[ "$made_policy" = 1 ] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends haproxy >/dev/null; }
echo "setup-haproxy: $(command -v haproxy)"
