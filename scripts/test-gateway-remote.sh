#!/usr/bin/env bash
# The remote gateway end to end (spec §15.4), as a user and an agent meet it: in a temporary
# home, start the appliance with a tunnel (the stand-in tests/fake_cloudflared.py, since the real
# Cloudflare service cannot be reached from CI), issue an agent certificate, authorize the agent,
# read through mTLS and through the tunnel with DPoP, upload a sealed payload and pull it, verify the
# audit log and one event's proof, revoke and see the refusals. Any failure
# exits non-zero. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
[ -x .venv/bin/uomp ] || bash scripts/setup.sh
PY=$ROOT/.venv/bin/python
UOMP=$ROOT/.venv/bin/uomp

WORK=$(mktemp -d /tmp/uomp-remote-XXXXXX)
export UOMP_HOME=$WORK/home
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export UOMP_GATEWAY_LISTEN_PORT=$(free_port)
export UOMP_GUARD_TCP_PORT=$(free_port)
mkdir -p "$WORK/bin"
ln -s "$ROOT/tests/fake_cloudflared.py" "$WORK/bin/cloudflared"
export PATH="$WORK/bin:$PATH"
export FAKE_CF_EDGE_FILE=$WORK/edge
GW=https://localhost:$UOMP_GATEWAY_LISTEN_PORT
APP_PID=""

step() { echo "== $*"; }
fail() { echo "FAIL: $*" >&2; [ -f "$WORK/gateway.log" ] && tail -n 30 "$WORK/gateway.log" >&2; exit 1; }
cleanup() {
  rc=$?
  "$UOMP" gateway stop --timeout 30 >/dev/null 2>&1 || true
  if [ -n "$APP_PID" ] && kill -0 "$APP_PID" 2>/dev/null; then kill -KILL "$APP_PID" 2>/dev/null || true; fi
  [ $rc -eq 0 ] && rm -rf "$WORK"
  [ $rc -ne 0 ] && echo "test-gateway-remote: FAILED (files kept in $WORK)" >&2
  exit $rc
}
trap cleanup EXIT
json() { "$PY" -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {'d': d}))" "$1"; }

step "init and a memory item"
"$UOMP" init >/dev/null
"$UOMP" memory add preference.theme --value '"dark"' --tag preference --sensitivity low >/dev/null

step "start the appliance with a quick tunnel (stand-in cloudflared)"
"$UOMP" gateway start --tunnel quick >"$WORK/gateway.log" 2>&1 &
APP_PID=$!
for _ in $(seq 1 600); do
  if "$UOMP" status >/dev/null 2>&1 && "$UOMP" status --json | grep -q trycloudflare; then break; fi
  kill -0 "$APP_PID" 2>/dev/null || fail "the appliance exited"
  sleep 0.1
done
STATUS=$("$UOMP" status --json) || fail "uomp status: not healthy"
TUNNEL_URL=$(echo "$STATUS" | json 'd["tunnel"]["public_url"]')
[[ $TUNNEL_URL == https://*.trycloudflare.com ]] || fail "no tunnel URL ($TUNNEL_URL)"
grep -q "^public URL: $TUNNEL_URL" "$WORK/gateway.log" || fail "the tunnel URL was not announced"
echo "   tunnel $TUNNEL_URL, mTLS $GW"

step "issue the agent's certificate, authorize it for mTLS and for the tunnel"
AGENT=$WORK/agent
mkdir -p "$AGENT/manifest"
cat >"$AGENT/manifest/uom.json" <<'EOF'
{"uomp_version": "1.0", "agent": {"id": "remote_test_agent", "name": "Remote test", "version": "1.0.0"},
 "requested_scopes": {"read": {"tags": ["preference"], "keys": []}},
 "required_capabilities": ["memory.read"], "requires_remote": true,
 "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"}}
EOF
"$UOMP" agent issue remote_test_agent --out "$AGENT/files" >/dev/null
"$UOMP" authorize "$AGENT/manifest" --remote --gateway-url "$GW" --cert "$AGENT/files/agent.crt" \
  --key-file "$AGENT/files/agent.key" --bundle "$AGENT/mtls-bundle.json" --yes >/dev/null
"$UOMP" authorize "$AGENT/manifest" --remote --gateway-url "$TUNNEL_URL" --cert "$AGENT/files/agent.crt" \
  --key-file "$AGENT/files/agent.key" --bundle "$AGENT/tunnel-bundle.json" --yes >/dev/null

step "read through mTLS (curl)"
TOKEN=$(json 'd["access_token"]' <"$AGENT/mtls-bundle.json")
mtls_get() {
  rm -f "$WORK/body"
  curl -s -o "$WORK/body" -w '%{http_code}' --cacert "$AGENT/files/ca.crt" --cert "$AGENT/files/agent.crt" \
    --key "$AGENT/files/agent.key" -H "Authorization: Bearer $TOKEN" -H "X-UOMP-Agent-Id: remote_test_agent" \
    "$GW/v1/memory/preference.theme" || true
}
code=$(mtls_get)
[ "$code" = 200 ] || fail "mTLS read answered $code: $(cat "$WORK/body")"
[ "$(json 'd["value"]' <"$WORK/body")" = dark ] || fail "mTLS read returned $(cat "$WORK/body")"

step "read through the tunnel with DPoP (SDK, via the stand-in edge)"
EDGE=$(cut -d' ' -f1 "$FAKE_CF_EDGE_FILE")
"$PY" - "$AGENT/tunnel-bundle.json" "http://127.0.0.1:$EDGE" "$TUNNEL_URL" <<'EOF' || fail "DPoP read through the tunnel"
import asyncio, sys
from gateway.client import UompClient

async def main() -> None:
    bundle, edge, public = sys.argv[1:4]
    async with UompClient.from_bundle(bundle, mode="dpop", base_url=edge, public_url=public) as c:
        assert (await c.get("preference.theme"))["value"] == "dark"
        await c.refresh()
        assert (await c.get("preference.theme"))["value"] == "dark"
asyncio.run(main())
EOF
"$UOMP" audit --json --limit 100000 | grep -q '"listener": *"tunnel"' || fail "no tunnel request in the one audit log"

step "upload a sealed payload (SDK over mTLS), pull and open it (CLI): only ciphertext on the relay"
SESSION=$(json 'd["session_id"]' <"$AGENT/mtls-bundle.json")
printf '# Portfolio report\nAAPL up 3%%.\n' >"$WORK/report.md"
PAYLOAD_ID=$("$PY" - "$AGENT/mtls-bundle.json" "$WORK/report.md" <<'EOF'
import asyncio, sys
from gateway.client import UompClient

async def main() -> None:
    bundle, path = sys.argv[1:3]
    async with UompClient.from_bundle(bundle) as c:
        print(await c.upload_payload(open(path, "rb").read(), format="text/markdown"))
asyncio.run(main())
EOF
) || fail "payload upload"
grep -rq "Portfolio report" "$UOMP_HOME/payloads" && fail "payload plaintext found on the relay"
"$UOMP" payload pull "$PAYLOAD_ID" --out "$WORK/pulled.md" >/dev/null || fail "uomp payload pull"
cmp -s "$WORK/report.md" "$WORK/pulled.md" || fail "the pulled payload differs from what the agent sealed"

step "the audit log verifies; one event's proof checks with nothing else"
"$UOMP" audit verify >/dev/null || fail "uomp audit verify"
EVENT=$("$UOMP" audit --json --session "$SESSION" | json 'd[0]["id"]')
"$UOMP" audit proof "$EVENT" --out "$WORK/proof.json" >/dev/null || fail "uomp audit proof $EVENT"
"$UOMP" audit verify-proof "$WORK/proof.json" | grep -q "proof OK" || fail "the proof bundle does not verify"

step "revoke the session: refused at once"
"$UOMP" sessions revoke "$SESSION" >/dev/null
code=$(mtls_get)
[ "$code" = 401 ] || fail "a revoked session answered $code"
grep -q SESSION_REVOKED "$WORK/body" || fail "revoked session: $(cat "$WORK/body")"

step "revoke the certificate: a 401 that names it and says why"
"$UOMP" agent revoke remote_test_agent >/dev/null
refused=""
for _ in $(seq 1 100); do  # the gateway reloads the CRL when the file changes
  code=$(mtls_get)
  if [ "$code" = 401 ] && grep -q '"CERT_REQUIRED"' "$WORK/body" 2>/dev/null; then refused=yes; break; fi
  sleep 0.1
done
[ -n "$refused" ] || fail "a revoked certificate was still accepted (last answer $code: $(cat "$WORK/body" 2>/dev/null))"
grep -q '"reason": *"revoked"' "$WORK/body" || fail "the refusal gives no reason: $(cat "$WORK/body")"
grep -q '(agent remote_test_agent, serial 0x[0-9a-f]*) was revoked on ' "$WORK/body" \
  || fail "the refusal does not name the certificate: $(cat "$WORK/body")"
# the guard refuses the revoked certificate at once; the gateway itself once it has reloaded the CRL
# (it watches the file): then even a route it answers alone refuses it
for _ in $(seq 1 100); do
  code=$(curl -s -o /dev/null -w '%{http_code}' --cacert "$AGENT/files/ca.crt" --cert "$AGENT/files/agent.crt" \
    --key "$AGENT/files/agent.key" "$GW/v1/health" || true)
  [ "$code" = 401 ] && break
  sleep 0.1
done
[ "$code" = 401 ] || fail "a revoked certificate reached /v1/health ($code) 10 s after its revocation"

step "stop: nothing left behind"
"$UOMP" gateway stop >/dev/null
app_rc=0; wait "$APP_PID" || app_rc=$?
[ $app_rc -eq 0 ] || fail "the appliance exited with status $app_rc"
pgrep -f "$WORK/bin/cloudflared" >/dev/null && fail "cloudflared left running"
[ -e "$UOMP_HOME/guard.sock" ] && fail "guard.sock left behind"
if "$UOMP" status >/dev/null 2>&1; then fail "uomp status says running"; fi
APP_PID=""
echo "test-gateway-remote: OK"
