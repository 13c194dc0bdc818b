#!/usr/bin/env bash
# Install Debian's headless-capable Chromium and its WebDriver (/usr/bin/chromium,
# /usr/bin/chromedriver) for the dashboard's browser tests (tests/e2e/test_dashboard_browser.py).
# Nothing is downloaded at test run time: the tests drive the system browser with Selenium.
# Idempotent: returns at once when /usr/bin/chromium and /usr/bin/chromedriver are there.
# Without apt-get (not Debian/Ubuntu) or without root it says so and exits 0: the browser tests
# then fail under CI=true and skip locally (see the test module).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "$0")/lib/apt.sh"
apt_install setup-browser chromium chromium-driver
[ -x /usr/bin/chromium ] && echo "setup-browser: $(/usr/bin/chromium --version 2>/dev/null || echo chromium installed)" || true
