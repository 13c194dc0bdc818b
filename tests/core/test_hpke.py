"""HPKE (RFC 9180) base mode: the RFC's known-answer vector A.1.1 (DHKEM(X25519, HKDF-SHA256),
HKDF-SHA256, AES-128-GCM: every step of the key schedule, ten sequenced encryptions, the exports),
and interoperation with cryptography's independent HPKE for the AES-256-GCM suite we use."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hpke as ref
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from gateway.core import hpke
from gateway.core.hpke import HpkeError

# RFC 9180 Appendix A.1.1: mode 0, KEM 0x0020, KDF 0x0001, AEAD 0x0001 (data only).
A11 = {
    "info": "4f6465206f6e2061204772656369616e2055726e",
    "ikmE": "7268600d403fce431561aef583ee1613527cff655c1343f29812e66706df3234",
    "ikmR": "6db9df30aa07dd42ee5e8181afdb977e538f5e1fec8a06223f33f7013e525037",
    "skEm": "52c4a758a802cd8b936eceea314432798d5baf2d7e9235dc084ab1b9cfa2f736",
    "skRm": "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8",
    "pkRm": "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d",
    "enc": "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431",
    "shared_secret": "fe0e18c9f024ce43799ae393c7e8fe8fce9d218875e8227b0187c04e7d2ea1fc",
    "key": "4531685d41d65f03dc48f6b8302c05b0",
    "base_nonce": "56d890e5accaaf011cff4b7d",
    "exporter_secret": "45ff1c2e220db587171952c0592d5f5ebe103f1561a2614e38f2ffd47e99e3f8",
}
PT = bytes.fromhex("4265617574792069732074727574682c20747275746820626561757479")
CIPHERTEXTS = {  # sequence number -> ciphertext (aad "Count-<seq>")
    0: "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
    1: "af2d7e9ac9ae7e270f46ba1f975be53c09f8d875bdc8535458c2494e8a6eab251c03d0c22a56b8ca42c2063b84",
    2: "498dfcabd92e8acedc281e85af1cb4e3e31c7dc394a1ca20e173cb72516491588d96a19ad4a683518973dcc180",
    255: "7175db9717964058640a3a11fb9007941a5d1757fda1a6935c805c21af32505bf106deefec4a49ac38d71c9e0a",
}
EXPORTS = [
    ("", "3853fe2b4035195a573ffc53856e77058e15d9ea064de3e59f4961d0095250ee"),
    ("00", "2e8f0b54673c7029649d4eb9d5e33bf1872cf76d623ff164ac185da9e88c21a5"),
]


def _h(name: str) -> bytes:
    return bytes.fromhex(A11[name])


def _raw_sk(sk: X25519PrivateKey) -> bytes:
    return sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def test_rfc9180_a11_derive_key_pair() -> None:
    assert _raw_sk(hpke.derive_key_pair(_h("ikmE"))) == _h("skEm")
    sk_r = hpke.derive_key_pair(_h("ikmR"))
    assert _raw_sk(sk_r) == _h("skRm")
    assert sk_r.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) == _h("pkRm")


def test_rfc9180_a11_sender_and_receiver() -> None:
    suite = hpke.X25519_SHA256_AES128GCM
    sk_e = hpke.derive_key_pair(_h("ikmE"))
    sk_r = hpke.derive_key_pair(_h("ikmR"))
    shared, enc = hpke.encap(sk_r.public_key(), eph=sk_e)
    assert enc == _h("enc") and shared == _h("shared_secret")
    assert hpke.decap(enc, sk_r) == _h("shared_secret")
    sender = hpke.key_schedule(suite, shared, _h("info"))
    receiver = hpke.setup_receiver(suite, enc, sk_r, _h("info"))
    assert sender.base_nonce == _h("base_nonce") and sender.exporter_secret == _h("exporter_secret")
    for i in range(256):
        aad = b"Count-%d" % i
        ct = sender.seal(PT, aad)
        assert receiver.open(ct, aad) == PT
        if i in CIPHERTEXTS:
            assert ct.hex() == CIPHERTEXTS[i]
    for ctx_hex, want in EXPORTS:
        assert receiver.export(bytes.fromhex(ctx_hex), 32).hex() == want


def test_open_refuses_wrong_aad_info_key_and_order() -> None:
    suite = hpke.X25519_SHA256_AES256GCM
    sk_r = X25519PrivateKey.generate()
    enc, ct = hpke.seal(suite, sk_r.public_key(), b"info", b"secret", b"aad")
    assert hpke.open_(suite, enc, sk_r, b"info", ct, b"aad") == b"secret"
    for args in [
        (enc, sk_r, b"info", ct, b"aaX"),
        (enc, sk_r, b"infX", ct, b"aad"),
        (enc, X25519PrivateKey.generate(), b"info", ct, b"aad"),
        (enc, sk_r, b"info", ct[:-1] + bytes([ct[-1] ^ 1]), b"aad"),
    ]:
        with pytest.raises(HpkeError):
            hpke.open_(suite, *args)
    # Second message opened first: the sequence number binds the order.
    enc, sender = hpke.setup_sender(suite, sk_r.public_key(), b"i")
    c0, c1 = sender.seal(b"zero"), sender.seal(b"one")
    receiver = hpke.setup_receiver(suite, enc, sk_r, b"i")
    with pytest.raises(HpkeError):
        receiver.open(c1)
    assert receiver.open(c0) == b"zero" and receiver.open(c1) == b"one"


@pytest.mark.parametrize("enc", [bytes(32), b"\x01" + bytes(31), b"short"], ids=["zero", "low-order", "short"])
def test_bad_encapsulated_keys(enc: bytes) -> None:
    with pytest.raises(HpkeError):
        hpke.decap(enc, X25519PrivateKey.generate())


REF = ref.Suite(ref.KEM.X25519, ref.KDF.HKDF_SHA256, ref.AEAD.AES_256_GCM)


@pytest.mark.parametrize("size", [0, 1, 32, 1000])
def test_interop_with_cryptography_hpke_aes256(size: int) -> None:
    suite = hpke.X25519_SHA256_AES256GCM
    sk_r = X25519PrivateKey.generate()
    msg = bytes(range(256)) * (size // 256) + bytes(size % 256)
    # Ours seals, theirs opens (their wire form is enc || ciphertext, no aad).
    enc, ct = hpke.seal(suite, sk_r.public_key(), b"uomp info", msg)
    assert REF.decrypt(enc + ct, sk_r, info=b"uomp info") == msg
    # Theirs seals, ours opens.
    blob = REF.encrypt(msg, sk_r.public_key(), info=b"uomp info")
    assert hpke.open_(suite, blob[:32], sk_r, b"uomp info", blob[32:]) == msg
