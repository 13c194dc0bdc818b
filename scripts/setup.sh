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
extras="[native]"
suffix=""
if [ "${1:-}" = "--dev" ]; then extras="[dev,native]"; suffix="-dev"; fi
stamp=".venv/.uomp-installed${suffix}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
# The request path compiled with mypyc for these sources (gateway/native.py; quick when built
# already). Without a C compiler it fails and says so: the appliance then runs as plain Python.
native() {
  .venv/bin/python -m gateway.cli.native build >&2 || echo "setup: continuing without the compiled request path" >&2
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import gateway" 2>/dev/null; then
  native
  exit 0
fi
echo "setup: installing uomp${extras} and its dependencies into .venv (first run: a minute or two, with the compile of the request path)..." >&2
log=$(mktemp)
if ! .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${extras}" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "setup: pip install failed" >&2; exit 1
fi
rm -f "$log"
echo "$want" > "$stamp"
native
echo "setup: done" >&2
