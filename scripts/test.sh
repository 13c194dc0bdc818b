#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up, lint, type-check, test.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev || { echo "setup failed"; exit 1; }
# npm `jose` for the TypeScript-reference interop test (node/npm ship with the machine image).
bash scripts/setup-interop.sh || { echo "interop setup failed"; exit 1; }
# npm anvil (a real local EVM chain) and solc-js for the anchoring tests, pinned by anchor-tools/.
bash scripts/setup-anvil.sh || { echo "anvil setup failed"; exit 1; }
bash scripts/setup-browser.sh || { echo "browser setup failed"; exit 1; }
bash scripts/setup-faketime.sh || { echo "faketime setup failed"; exit 1; }
bash scripts/setup-redis.sh || { echo "redis setup failed"; exit 1; }
bash scripts/setup-haproxy.sh || { echo "haproxy setup failed"; exit 1; }
status=0
bash scripts/lint.sh || status=1
echo "== pytest"
.venv/bin/python -m pytest -q "$@"
rc=$?
# pytest exit 5 = no tests collected: that is a failure of the suite, not a pass.
if [ $rc -eq 5 ]; then echo "pytest collected no tests"; rc=1; fi
[ $rc -ne 0 ] && status=1
echo "== fuzz (bounded, every parser)"; bash scripts/fuzz.sh --seconds 20 || status=1
echo "== test-gateway-remote (spec §15.4)"
bash scripts/test-gateway-remote.sh || status=1
exit $status
