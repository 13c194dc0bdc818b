"""Secrets at rest: the home's private keys sealed under one master key.

* :mod:`gateway.atrest.sealing`: the formats and the cryptography (Argon2id, AES-256-GCM, HKDF);
  no file or process state;
* :mod:`gateway.atrest.vault`: the process's unlocked master keys, where a passphrase comes from,
  and the two calls every key loader and writer goes through (:func:`~gateway.atrest.vault.read_key`,
  :func:`~gateway.atrest.vault.write_key`);
* :mod:`gateway.atrest.itemseal`: the values of high-sensitivity memory items sealed one by one
  (AES-256-GCM, a key per item), under ``.secrets/items.key``;
* :mod:`gateway.atrest.migrate`: ``uomp secrets seal`` / ``unseal``, one journal, crash-safe;
* :mod:`gateway.atrest.backup`: ``uomp backup create | verify | restore``, to a passphrase or to an
  X25519 recipient (:mod:`gateway.atrest.recipient`).

docs/security.md "Keys at rest" is the user's description.
"""
