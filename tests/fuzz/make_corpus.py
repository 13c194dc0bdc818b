"""Write the seed corpus (tests/fuzz/corpus/<target>/): valid and near-valid inputs per parser.

Run from the repository root: ``.venv/bin/python tests/fuzz/make_corpus.py``. The fuzzer adds what
it finds interesting to a scratch copy, never to these files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cryptography.hazmat.primitives.asymmetric import ec
from targets import _NOTE, BINDING, PAYLOAD_KEY, good_token

from gateway.client import payloads
from gateway.core import dpop

OUT = Path(__file__).parent / "corpus"


def seeds() -> dict[str, list[bytes]]:
    tok = good_token().encode()
    env = payloads.seal_small(PAYLOAD_KEY.public_key(), BINDING, b"hello")
    key = ec.generate_private_key(ec.SECP256R1())
    proof = dpop.make_dpop_proof(
        key, method="GET", url="https://gw.example/v1/memory/x", access_token="tok", now=1_780_000_000.0
    )
    return {
        "token": [tok, tok[:-3], b"\x00\x05z", good_token(exp=1).encode()],
        "jose": [tok, b"e30.e30.", b"eyJhbGciOiJub25lIn0.e30."],
        "dpop": [proof.encode() + b"\nhttps://gw.example/v1/memory/x", b"a.b.c\nhttps://x/%2e%2E/a"],
        "pathnorm": [
            b"/v1/memory/preference.theme",
            b"/v1/memory?tag=a%20b&cursor=x",
            b"/v1/%2e%2e/x",
            b"/v1/memory/a%2Fb",
            b"//x",
            b"/v1/memory/%C3%A9",
        ],
        "envelope": [
            json.dumps(env).encode(),
            json.dumps({k: v for k, v in env.items() if k != "ciphertext"}).encode(),
            json.dumps({**{k: v for k, v in env.items() if k != "ciphertext"}, "hash": "sha256:trailer"}).encode(),
        ],
        "sealing": [b"\x00\x00\x10\x00\x01", b"\x01\x02\x03\x01x", b"\xff\xff\xff\x00\x02"],
        "merkle": [b"\x07\x03\x02", b"\x27\x00\x10" + bytes(64), b"\x01\x00\x00"],
        "upstream": [
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2",
            b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked",
            b"HTTP/1.0 404 Not Found\r\nX:  y \t",
        ],
        "checkpoint": [
            _NOTE.encode(),
            _NOTE.replace("\n3\n", "\n4\n").encode(),
            b"origin\n1\nAAAA\n\n\xe2\x80\x94 x y\n",
        ],
        "importer": [
            b'[{"key":"a","value":1,"tags":["t"]}]',
            b'key,tags,value\na,t,1\nb,"t;u",2\n',
            b'{"key":"a","value":{"x":[1,2]},"tags":"t","sensitivity":"high"}',
            b"key,tags\n,\n",
        ],
    }


def main() -> None:
    for name, items in seeds().items():
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(items):
            (d / f"seed-{i:02d}").write_bytes(data)


if __name__ == "__main__":
    main()
