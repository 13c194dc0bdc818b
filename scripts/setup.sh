#!/usr/bin/env bash
# Set up everything the project needs on a fresh machine: a virtualenv with the package and
# its dev tools (from pyproject.toml). Idempotent and quick when nothing changed (a stamp records
# the pyproject.toml it was installed from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the virtualenv .venv" >&2
  "$PY" -m venv .venv
fi
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
stamp=".venv/.uomp-installed${extras:+-dev}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import gateway" 2>/dev/null; then
  exit 0
fi
echo "setup: installing uomp${extras} and its dependencies into .venv (first run: about a minute)..." >&2
log=$(mktemp)
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "setup: pip install failed" >&2; exit 1
fi
rm -f "$log"
echo "$want" > "$stamp"
echo "setup: done" >&2
