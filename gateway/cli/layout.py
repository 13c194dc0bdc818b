"""``uomp authorize --remote --layout uomp-core --out DIR``: the agent's files where the reference
TypeScript SDK (github.com/0xaicrypto/uomp-core, ``@uomp/sdk``) looks for them, so its agents run
unmodified against this appliance. DIR plays the agent's ``~/.uomp``:

* ``DIR/.gateway-certs/client.crt``, ``client.key`` (PKCS#8 PEM, 0600), ``ca.crt``: the SDK loads
  them for mTLS whenever its base URL is ``https://``;
* ``DIR/uomp.env`` (0600): ``UOM_TOKEN``, ``UOMP_BASE_URL`` (the gateway URL) and
  ``UOMP_SESSION_ID``, the variables its ``UompClient`` reads;
* ``DIR/bundle.json``: our own bundle as well (our SDK refreshes the tokens, the reference does not).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from gateway import ca_store
from gateway.fsutil import atomic_write

LAYOUTS = ("uomp", "uomp-core")
CERT_DIR = ".gateway-certs"
ENV_FILE = "uomp.env"


def certs_dir(out: Path) -> Path:
    """Where the reference SDK looks for its mTLS files under its home ``out`` (its ``~/.uomp``)."""
    return out / CERT_DIR


def rename_for_reference(files: ca_store.IssuedFiles) -> ca_store.IssuedFiles:
    """agent.key / agent.crt as issued, renamed to the reference's client.key / client.crt."""
    key, cert = files.out_dir / "client.key", files.out_dir / "client.crt"
    os.replace(files.key_file, key)
    os.replace(files.cert_file, cert)
    return replace(files, key_file=key, cert_file=cert)


def write_env(out: Path, *, token: str, base_url: str, session_id: str) -> Path:
    """The env file (0600) with the names the reference's agents read; its path."""
    path = out / ENV_FILE
    text = f"UOM_TOKEN={token}\nUOMP_BASE_URL={base_url}\nUOMP_SESSION_ID={session_id}\n"
    atomic_write(path, text.encode(), mode=0o600)
    return path
