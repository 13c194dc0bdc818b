#!/bin/sh
# The container's entry point: `uomp init` (with the public host names in UOMP_HOSTNAME,
# comma-separated) before `gateway start`, then the command. Errors are uomp's own one-line
# messages (an unwritable /data volume: HOME_UNWRITABLE with the fix).
set -eu
if [ "${1:-}" = "gateway" ] && [ "${2:-}" = "start" ]; then
  set -f  # UOMP_HOSTNAME is split on commas only, never globbed
  hosts=""
  old_ifs=$IFS; IFS=","
  for h in ${UOMP_HOSTNAME:-}; do
    h=$(printf '%s' "$h" | tr -d ' ')
    [ -n "$h" ] && hosts="$hosts --hostname $h"
  done
  IFS=$old_ifs
  # shellcheck disable=SC2086  # one word per host name
  uomp init $hosts >&2
fi
exec uomp "$@"
