// Compile one contract file (contracts/NAME.sol, holding the contract NAME) with the pinned solc-js
// (package.json) and print the artifact (ABI, creation and runtime bytecode, compiler version and
// settings) as JSON on stdout.
// Deterministic: same source + same compiler + these fixed settings = the same bytes.
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { basename } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const solc = require("solc");
const PINNED = require("./package.json").dependencies.solc;

const sourcePath = process.argv[2];
if (!sourcePath) {
  console.error("usage: node build-contract.mjs contracts/UompAnchor.sol");
  process.exit(2);
}
const version = solc.version();
if (!version.startsWith(PINNED + "+")) {
  console.error(`solc ${version} is not the pinned ${PINNED}`);
  process.exit(1);
}
const source = readFileSync(sourcePath, "utf8");
const fileName = basename(sourcePath);
const contractName = fileName.replace(/\.sol$/, "");
const settings = {
  optimizer: { enabled: true, runs: 200 },
  viaIR: true,
  evmVersion: "cancun",
  metadata: { bytecodeHash: "ipfs" },
  outputSelection: { "*": { "*": ["abi", "evm.bytecode.object", "evm.deployedBytecode.object"] } },
};
const input = {
  language: "Solidity",
  sources: { [fileName]: { content: source } },
  settings,
};
const output = JSON.parse(solc.compile(JSON.stringify(input)));
const errors = (output.errors || []).filter((e) => e.severity === "error");
for (const e of output.errors || []) console.error(e.formattedMessage);
if (errors.length) process.exit(1);
const c = output.contracts[fileName][contractName];
const artifact = {
  contractName,
  source: `contracts/${fileName}`,
  sourceSha256: createHash("sha256").update(source, "utf8").digest("hex"),
  compiler: { name: "solc-js", version },
  settings: { optimizer: settings.optimizer, viaIR: settings.viaIR, evmVersion: settings.evmVersion, metadata: settings.metadata },
  abi: c.abi,
  bytecode: "0x" + c.evm.bytecode.object,
  deployedBytecode: "0x" + c.evm.deployedBytecode.object,
};
process.stdout.write(JSON.stringify(artifact, null, 2) + "\n");
