#!/usr/bin/env bash
# Rebuild the committed contract artifacts (ABI, creation and runtime bytecode), offline, with the
# solc-js version pinned in anchor-tools/package.json (optimizer on, 200 runs, viaIR, evmVersion
# cancun: see anchor-tools/build-contract.mjs):
#   contracts/UompAnchor.sol               -> gateway/anchor/UompAnchor.json
#   contracts/Erc8004IdentityRegistry.sol  -> gateway/registry/Erc8004IdentityRegistry.json
#   contracts/Erc8004ReputationRegistry.sol -> gateway/registry/Erc8004ReputationRegistry.json
#   bash scripts/build-contract.sh           write the artifacts (atomically)
#   bash scripts/build-contract.sh --check   exit 1 if a committed artifact differs
set -euo pipefail
cd "$(dirname "$0")/.."
command -v node >/dev/null 2>&1 || { echo "build-contract: node not found" >&2; exit 1; }
bash scripts/setup-anvil.sh
status=0
for pair in UompAnchor:gateway/anchor Erc8004IdentityRegistry:gateway/registry Erc8004ReputationRegistry:gateway/registry; do
  name=${pair%%:*}
  out=${pair#*:}/$name.json
  tmp=$(mktemp "$out.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  (cd anchor-tools && node build-contract.mjs "../contracts/$name.sol") > "$tmp"
  if [ "${1:-}" = "--check" ]; then
    if cmp -s "$tmp" "$out"; then echo "build-contract: $out is up to date"
    else echo "build-contract: $out differs from a fresh build of contracts/$name.sol" >&2; status=1; fi
    rm -f "$tmp"
    continue
  fi
  chmod 0644 "$tmp"
  sync "$tmp"
  mv -f "$tmp" "$out"
  trap - EXIT
  echo "build-contract: wrote $out"
done
exit $status
