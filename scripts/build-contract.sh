#!/usr/bin/env bash
# Rebuild gateway/anchor/UompAnchor.json (ABI, creation and runtime bytecode) from
# contracts/UompAnchor.sol, offline, with the solc-js version pinned in anchor-tools/package.json
# (optimizer on, 200 runs, viaIR, evmVersion cancun: see anchor-tools/build-contract.mjs).
#   bash scripts/build-contract.sh           write the artifact (atomically)
#   bash scripts/build-contract.sh --check   exit 1 if the committed artifact differs
set -euo pipefail
cd "$(dirname "$0")/.."
command -v node >/dev/null 2>&1 || { echo "build-contract: node not found" >&2; exit 1; }
bash scripts/setup-anvil.sh
out=gateway/anchor/UompAnchor.json
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
(cd anchor-tools && node build-contract.mjs ../contracts/UompAnchor.sol) > "$tmp"
if [ "${1:-}" = "--check" ]; then
  if cmp -s "$tmp" "$out"; then echo "build-contract: $out is up to date"; exit 0; fi
  echo "build-contract: $out differs from a fresh build of contracts/UompAnchor.sol" >&2; exit 1
fi
chmod 0644 "$tmp"
sync "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
echo "build-contract: wrote $out"
