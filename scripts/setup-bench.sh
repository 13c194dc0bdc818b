#!/usr/bin/env bash
# Install the Debian tools the benchmarks compare against or drive load with:
#   nginx         bench_nginx.py: TLS 1.3 mutual TLS in front of the same guard (keep-alive upstream
#                 to its Unix socket), the best proxy a user could put there;
#   apache2-utils `ab` (ab -k, ab -E cert for a client certificate): bench_nginx.py --ab, bench_guard.py;
#   wrk           bench_guard.py's calibration of the Python load generator;
#   strace        bench_gateway.py --fsyncs.
# Nothing is downloaded at benchmark run time; the benchmarks only run what is installed here.
# Idempotent: returns at once when every tool is there (installs through scripts/lib/apt.sh).
# Without apt-get (not Debian/Ubuntu) or without root it says what to install and exits 0: the
# benchmarks then say which tool is missing and skip that part.
set -euo pipefail
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v ab >/dev/null 2>&1 || need+=(apache2-utils)
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v strace >/dev/null 2>&1 || need+=(strace)
if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "$0")/lib/apt.sh"
apt_install setup-bench "${need[@]}"
# The package's own server (its postinst starts it on port 80 with /etc/nginx/nginx.conf) is not
# what the benchmarks run: they start nginx themselves, on ephemeral loopback ports, with a
# configuration of their own. Stop the package's instance if the install started it.
if [ -s /run/nginx.pid ] && /usr/sbin/nginx -t -q 2>/dev/null; then
  /usr/sbin/nginx -s quit 2>/dev/null || true
fi
if command -v ab >/dev/null 2>&1; then
  echo "setup-bench: $( (nginx -v 2>&1 || /usr/sbin/nginx -v 2>&1) | head -1), $(ab -V | head -1)"
fi
