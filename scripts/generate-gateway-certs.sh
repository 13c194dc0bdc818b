#!/usr/bin/env bash
# Quick local mTLS setup for the UOMP gateway (spec §15.4 names this script).
#
#   scripts/generate-gateway-certs.sh [AGENT_ID [OUT_DIR]] [--hostname H]...
#
# 1. `uomp init`: data directory ($UOMP_HOME, default ~/.uomp), signing key, admin credential,
#    and the user CA + gateway server certificate + empty CRL (never replaces an existing CA);
# 2. `uomp ca init --hostname H ...` when host names are given (adds them to the gateway cert);
# 3. `uomp agent issue AGENT_ID --out OUT_DIR`: agent.key (0600), agent.crt (24 h), ca.crt.
# AGENT_ID defaults to "demo-agent", OUT_DIR to $UOMP_HOME/agents/AGENT_ID.
# Uses .venv/bin/uomp when the project's virtualenv exists, else `uomp` on PATH.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ -x "$here/.venv/bin/uomp" ]; then
  UOMP="$here/.venv/bin/uomp"
elif command -v uomp >/dev/null 2>&1; then
  UOMP="$(command -v uomp)"
else
  echo "uomp not found: run scripts/setup.sh first (or put uomp on PATH)" >&2
  exit 1
fi

positional=()
hostnames=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hostname) [ $# -ge 2 ] || { echo "--hostname needs a value" >&2; exit 2; }
                hostnames+=(--hostname "$2"); shift 2 ;;
    --hostname=*) hostnames+=(--hostname "${1#--hostname=}"); shift ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) positional+=("$1"); shift ;;
  esac
done
agent_id="${positional[0]:-demo-agent}"
home="${UOMP_HOME:-$HOME/.uomp}"
out_dir="${positional[1]:-$home/agents/$agent_id}"

"$UOMP" init
if [ ${#hostnames[@]} -gt 0 ]; then
  "$UOMP" ca init "${hostnames[@]}"
fi
"$UOMP" agent issue "$agent_id" --out "$out_dir"

ca_dir="$home/ca"
cat <<INFO

Gateway (server side), in $ca_dir:
  server certificate  $ca_dir/gateway.crt
  server key          $ca_dir/gateway.key
  agent CA            $ca_dir/ca.crt
  CRL                 $ca_dir/crl.pem
Agent "$agent_id" (give these to the agent), in $out_dir:
  client certificate  $out_dir/agent.crt
  client key          $out_dir/agent.key
  CA to trust         $out_dir/ca.crt
Try it against a running gateway (default port 9443):
  curl --cacert $out_dir/ca.crt --cert $out_dir/agent.crt --key $out_dir/agent.key https://localhost:9443/v1/health
The agent certificate lasts 24 h: run this script again to renew it (the same key is reused).
INFO
