# shellcheck shell=bash
# apt_install LABEL PACKAGE...: install Debian packages for the setup scripts, quietly.
# Without apt-get (not Debian/Ubuntu) or without root it says what to install and returns 0: the
# tests or benchmarks that need the tool then say so (and fail under CI=true). Packages' own
# services are not started during the install (a policy-rc.d that refuses them, removed after);
# the package index is refreshed only when the first try fails (a fresh image has none).
apt_install() {
  local label=$1
  shift
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "$label: apt-get not found; install $* yourself" >&2
    return 0
  fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "$label: not root; install them yourself (apt-get install $*)" >&2
    return 0
  fi
  local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
         && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
    || rc=$?
  if [ "$made_policy" = 1 ]; then
    rm -f "$policy"
  fi
  return "$rc"
}
