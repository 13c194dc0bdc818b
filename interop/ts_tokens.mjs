#!/usr/bin/env node
// Interop harness: UOMP capability tokens made and checked by the npm `jose` library, the way the
// public TypeScript reference (0xaicrypto/uomp-core) does it. Used by tests/test_interop_ts.py.
//
//   node ts_tokens.mjs keygen DIR [DIR...]
//       New Ed25519 key pair per DIR, written as DIR/.secrets/ed25519-private.jwk and
//       DIR/.secrets/ed25519-public.jwk, as the reference writes them: kid "uomp-auth-key-1",
//       alg "EdDSA", JSON indented by two spaces, no trailing newline, no explicit file mode (so the
//       process umask decides; the reference does not restrict the private key to 0600).
//       Prints each public JWK, one JSON line per DIR.
//   node ts_tokens.mjs mint DIR CLAIMS_JSON_FILE
//       CLAIMS_JSON_FILE holds one claims object or an array of them. For each, prints one compact
//       JWS signed with DIR's private JWK: header {alg: "EdDSA", kid}, iat = now and exp taken from
//       the claims' expires_at (as the reference does). One token per line.
//   node ts_tokens.mjs verify DIR TOKEN [TOKEN...]
//       jwtVerify with DIR's public JWK and algorithms ["EdDSA"]. For each token prints one JSON
//       line: {"payload": ..., "protectedHeader": ...} when it verifies, else
//       {"error": {"code", "name", "message"}} (also written to stderr). Exits 1 if any token
//       failed, 0 otherwise.
//
// Exit status 2 for usage errors or unreadable key/claims files.

import { mkdir, readFile, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { exportJWK, generateKeyPair, importJWK, jwtVerify, SignJWT } from 'jose';

const KID = 'uomp-auth-key-1';
const ALG = 'EdDSA';
const SECRETS = '.secrets';
const PRIVATE_FILE = 'ed25519-private.jwk';
const PUBLIC_FILE = 'ed25519-public.jwk';

class UsageError extends Error {}

async function readJson(path, what) {
  let text;
  try {
    text = await readFile(path, 'utf-8');
  } catch (err) {
    throw new UsageError(`cannot read ${what} ${path}: ${err.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new UsageError(`${what} ${path} is not JSON: ${err.message}`);
  }
}

async function keygen(dirs) {
  if (dirs.length === 0) throw new UsageError('keygen needs at least one DIR');
  for (const dir of dirs) {
    const secrets = join(dir, SECRETS);
    const { privateKey, publicKey } = await generateKeyPair(ALG, { crv: 'Ed25519' });
    const priv = { ...(await exportJWK(privateKey)), kid: KID, alg: ALG };
    const pub = { ...(await exportJWK(publicKey)), kid: KID, alg: ALG };
    await mkdir(secrets, { recursive: true });
    await writeFile(join(secrets, PRIVATE_FILE), JSON.stringify(priv, null, 2));
    await writeFile(join(secrets, PUBLIC_FILE), JSON.stringify(pub, null, 2));
    process.stdout.write(`${JSON.stringify(pub)}\n`);
  }
  return 0;
}

async function mint(dir, claimsFile) {
  if (!dir || !claimsFile) throw new UsageError('mint needs DIR and CLAIMS_JSON_FILE');
  const jwk = await readJson(join(dir, SECRETS, PRIVATE_FILE), 'private JWK');
  const key = await importJWK(jwk, ALG);
  const doc = await readJson(claimsFile, 'claims file');
  const all = Array.isArray(doc) ? doc : [doc];
  for (const claims of all) {
    if (claims === null || typeof claims !== 'object' || Array.isArray(claims)) {
      throw new UsageError('each claims entry must be a JSON object');
    }
    const expires = new Date(claims.expires_at);
    if (Number.isNaN(expires.getTime())) throw new UsageError('claims need an ISO 8601 expires_at');
    const token = await new SignJWT(claims)
      .setProtectedHeader({ alg: ALG, kid: jwk.kid ?? 'uomp-key' })
      .setIssuedAt()
      .setExpirationTime(expires)
      .sign(key);
    process.stdout.write(`${token}\n`);
  }
  return 0;
}

async function verify(dir, tokens) {
  if (!dir || tokens.length === 0) throw new UsageError('verify needs DIR and at least one TOKEN');
  const jwk = await readJson(join(dir, SECRETS, PUBLIC_FILE), 'public JWK');
  const key = await importJWK(jwk, ALG);
  let failed = 0;
  for (const token of tokens) {
    try {
      const { payload, protectedHeader } = await jwtVerify(token, key, { algorithms: [ALG] });
      process.stdout.write(`${JSON.stringify({ payload, protectedHeader })}\n`);
    } catch (err) {
      failed += 1;
      const error = { code: err.code ?? null, name: err.name ?? 'Error', message: String(err.message ?? err) };
      process.stdout.write(`${JSON.stringify({ error })}\n`);
      process.stderr.write(`verify failed: ${error.code ?? error.name}: ${error.message}\n`);
    }
  }
  return failed ? 1 : 0;
}

async function main(argv) {
  const [command, ...rest] = argv;
  switch (command) {
    case 'keygen':
      return keygen(rest);
    case 'mint':
      if (rest.length !== 2) throw new UsageError('usage: mint DIR CLAIMS_JSON_FILE');
      return mint(rest[0], rest[1]);
    case 'verify':
      return verify(rest[0], rest.slice(1));
    default:
      throw new UsageError('usage: ts_tokens.mjs keygen DIR... | mint DIR CLAIMS_JSON_FILE | verify DIR TOKEN...');
  }
}

main(process.argv.slice(2)).then(
  (code) => {
    process.exitCode = code;
  },
  (err) => {
    process.stderr.write(`ts_tokens: ${err instanceof UsageError ? '' : `${err.code ?? err.name}: `}${err.message}\n`);
    process.exitCode = 2;
  },
);
