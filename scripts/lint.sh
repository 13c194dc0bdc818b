#!/usr/bin/env bash
# The quick checks, in seconds and without the heavy setup (no npm, anvil or chromium):
# format, lint, strict types, layering contracts, no import cycle among gateway/ modules.
# Needs only the Python dev tools: `bash scripts/setup.sh --dev` once.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/ruff ] || bash scripts/setup.sh --dev || { echo "setup failed"; exit 1; }
status=0
echo "== ruff format --check"; .venv/bin/ruff format --check --quiet . || status=1
echo "== ruff"; .venv/bin/ruff check gateway tests scripts benchmarks examples || status=1
echo "== mypy (strict, gateway/)"; .venv/bin/mypy || status=1
echo "== import-linter (layering contracts in pyproject.toml)"; .venv/bin/lint-imports --no-cache || status=1
echo "== import cycles (none, annotation-only imports included)"; .venv/bin/python scripts/import_cycles.py || status=1
exit $status
