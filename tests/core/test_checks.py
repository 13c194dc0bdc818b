"""The shared token checks (gateway/core/checks.py) and the header contract (gateway/contract.py), pure."""

from __future__ import annotations

import dataclasses
import time

import pytest

from gateway import contract
from gateway.core import capability, checks, tokens
from gateway.errors import UompError

NOW = int(time.time())
BASE = tokens.parse_claims(
    {"alg": "EdDSA", "kid": "k"},
    tokens.capability_claims(
        session_id="s",
        agent_id="agent_a",
        now=NOW,
        expires=NOW + 60,
        read=capability.Scope(tags=("t",)),
        profile="remote",
        audience="https://gw.example:9443",
        allowed_endpoints=["gw.example:9443"],
        cnf={"x5t#S256": "X" * 43, "jkt": "J" * 43},
    ),
)
MTLS = checks.Presented(
    token_use="access",
    profile="remote",
    audiences={"https://gw.example:9443"},
    audience_required=True,
    endpoint="gw.example:9443",
    check_endpoint=True,
    header_agent="agent_a",
    require_header_agent=True,
    proven_agent="agent_a",
    x5t="X" * 43,
    jkt="J" * 43,
    binding=checks.BIND_EITHER,
)

CASES: list[tuple[str, dict[str, object], str | None]] = [
    ("all agree", {}, None),
    ("jkt alone proves the key (renewed certificate)", {"x5t": "Y" * 43}, None),
    ("refresh route", {"token_use": "refresh"}, "INVALID_TOKEN"),
    ("local listener", {"profile": "local"}, "INVALID_TOKEN"),
    ("another listener's audience", {"audiences": {"https://tunnel.example"}}, "INVALID_TOKEN"),
    ("endpoint unknown to the listener", {"endpoint": None}, "ACCESS_DENIED"),
    ("another endpoint", {"endpoint": "tunnel.example"}, "ACCESS_DENIED"),
    ("header agent missing", {"header_agent": None}, "INVALID_REQUEST"),
    ("header agent differs", {"header_agent": "agent_b"}, "AGENT_MISMATCH"),
    ("certificate agent differs", {"proven_agent": "agent_b"}, "AGENT_MISMATCH"),
    ("other certificate and key", {"x5t": "Y" * 43, "jkt": "K" * 43}, "TOKEN_BINDING_MISMATCH"),
    ("nothing proven", {"x5t": None, "jkt": None}, "CERT_REQUIRED"),
    ("dpop other key", {"binding": checks.BIND_JKT, "x5t": None, "jkt": "K" * 43}, "TOKEN_BINDING_MISMATCH"),
    ("bound token on the local profile", {"binding": checks.BIND_NONE, "profile": "remote"}, "TOKEN_BINDING_MISMATCH"),
]


@pytest.mark.parametrize(("name", "change", "code"), CASES, ids=[c[0] for c in CASES])
def test_checks_in_order(name: str, change: dict[str, object], code: str | None) -> None:
    presented = dataclasses.replace(MTLS, **change)  # type: ignore[arg-type]
    if code is None:
        checks.run_checks(BASE, presented)
        return
    with pytest.raises(UompError) as err:
        checks.run_checks(BASE, presented)
    assert err.value.code == code


ALLOWED = [
    ("host:port", ("gw.example:9443",), "gw.example:9443", True),
    ("bare host, any port", ("gw.example",), "gw.example:9443", True),
    ("url", ("https://gw.example:9443/",), "gw.example:9443", True),
    ("url default port", ("https://gw.example",), "gw.example", True),
    ("other port", ("gw.example:1",), "gw.example:9443", False),
    ("other host", ("evil.example",), "gw.example", False),
    ("suffix is not a match", ("example",), "gw.example", False),
    ("empty entry", ("",), "gw.example", False),
    ("ipv6", ("[::1]:9443",), "[::1]:9443", True),
    ("loopback names are one host", ("localhost:9443",), "127.0.0.1:9443", True),
    ("loopback names, url", ("https://127.0.0.1:9443",), "localhost:9443", True),
    ("loopback v6", ("localhost:9443",), "[::1]:9443", True),
    ("loopback, other port", ("localhost:9443",), "127.0.0.1:9444", False),
    ("loopback is not another host", ("localhost:9443",), "gw.example:9443", False),
    ("a name starting localhost", ("localhost.evil.example:9443",), "localhost:9443", False),
    ("another host is not loopback", ("gw.example:9443",), "127.0.0.1:9443", False),
]


@pytest.mark.parametrize(("name", "allowed", "endpoint", "ok"), ALLOWED, ids=[a[0] for a in ALLOWED])
def test_endpoint_allowed(name: str, allowed: tuple[str, ...], endpoint: str, ok: bool) -> None:
    assert checks.endpoint_allowed(allowed, endpoint) is ok


HEADERS: list[tuple[str, list[tuple[bytes, bytes]], bool, bool]] = [
    # name, raw headers, verified allowed, refused
    ("plain", [(b"Host", b"h"), (b"Authorization", b"Bearer a")], False, False),
    ("two authorization", [(b"Authorization", b"a"), (b"Authorization", b"b")], False, True),
    ("two authorization, mixed case", [(b"authorization", b"a"), (b"AUTHORIZATION", b"b")], False, True),
    ("two dpop", [(b"DPoP", b"a"), (b"dpop", b"b")], False, True),
    ("two hosts", [(b"Host", b"a"), (b"host", b"a")], False, True),
    ("two content-length", [(b"Content-Length", b"1"), (b"content-length", b"1")], False, True),
    ("two transfer-encoding", [(b"Transfer-Encoding", b"chunked"), (b"transfer-encoding", b"chunked")], False, True),
    ("two agent ids", [(b"X-UOMP-Agent-Id", b"a"), (b"x-uomp-agent-id", b"a")], False, True),
    ("two accepts are fine", [(b"Accept", b"a"), (b"accept", b"b")], False, False),
    ("client verified header", [(b"X-UOMP-Verified-Agent", b"a")], False, True),
    ("verified header on the socket", [(b"X-UOMP-Verified-Agent", b"a")], True, False),
    ("unknown verified header on the socket", [(b"X-UOMP-Verified-Root", b"1")], True, True),
    (
        "verified header twice on the socket",
        [(b"X-UOMP-Verified-Token", b"a"), (b"x-uomp-verified-token", b"a")],
        True,
        True,
    ),
]


@pytest.mark.parametrize(("name", "raw", "verified_allowed", "refused"), HEADERS, ids=[h[0] for h in HEADERS])
def test_header_problem(name: str, raw: list[tuple[bytes, bytes]], verified_allowed: bool, refused: bool) -> None:
    assert (contract.header_problem(raw, verified_allowed=verified_allowed) is not None) is refused


def test_an_endpoint_refusal_says_where_to_send_the_token_instead() -> None:
    with pytest.raises(UompError) as err:
        checks.run_checks(BASE, dataclasses.replace(MTLS, endpoint="other.example:9443"))
    assert err.value.code == "ACCESS_DENIED"
    assert err.value.message == (
        "token is not allowed on this endpoint: it is for gw.example:9443, this request came to host "
        "'other.example:9443'; send it to https://gw.example:9443 (the URL it was authorized for), or authorize "
        "the agent again with --gateway-url https://other.example:9443"
    )
