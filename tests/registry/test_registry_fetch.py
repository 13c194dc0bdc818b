"""The fetch rules (gateway/registry/fetch.py) against a loopback HTTPS server with a CA made here,
the registration-file checks (card.py) and the written-out ABI constants (chain.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from registrykit import DocServer, artifact, keccak, registration

from gateway.errors import ErrorCode, UompError
from gateway.registry import card, chain
from gateway.registry.fetch import FetchPolicy, decode_data_uri, fetch, shown


@pytest.fixture
def docs(tmp_path: Path) -> Iterator[DocServer]:
    server = DocServer(tmp_path)
    yield server
    server.close()


def ok_policy(docs: DocServer, **kw: object) -> FetchPolicy:
    base: dict[str, object] = {"allow_internal": True, "ca_file": docs.ca_file, "timeout_s": 5.0}
    base.update(kw)
    return FetchPolicy(**base)  # type: ignore[arg-type]


def refused(url: str, policy: FetchPolicy) -> str:
    with pytest.raises(UompError) as info:
        fetch(url, policy)
    assert info.value.code == ErrorCode.FETCH_FAILED
    return info.value.message


def test_a_good_fetch_and_a_redirect_within_the_bound(docs: DocServer) -> None:
    url = docs.put("/a.json", b'{"a": 1}')
    got = fetch(url, ok_policy(docs))
    assert got.body == b'{"a": 1}' and got.content_type == "application/json"
    docs.behave("/r1", "redirect:/r2")
    docs.behave("/r2", "redirect:/a.json")
    assert fetch(docs.url("/r1"), ok_policy(docs, max_redirects=2)).body == b'{"a": 1}'
    # denied partner: one redirect fewer allowed than the chain has
    assert "more than 1 redirects" in refused(docs.url("/r1"), ok_policy(docs, max_redirects=1))


def test_redirect_loop_is_refused(docs: DocServer) -> None:
    assert "redirects; refused" in refused(docs.behave("/loop", "loop"), ok_policy(docs))


def test_redirect_to_plain_http_elsewhere_is_refused(docs: DocServer) -> None:
    docs.behave("/down", "redirect:http://example.com/x.json")
    assert "plain http is refused" in refused(docs.url("/down"), ok_policy(docs))


@pytest.mark.parametrize(
    "url",
    [
        pytest.param("http://example.com/a.json", id="plain-http"),
        pytest.param("file:///etc/passwd", id="file"),
        pytest.param("ftp://example.com/a", id="ftp"),
        pytest.param("ipfs://bafy", id="ipfs"),
        pytest.param("https://user:pw@example.com/a", id="userinfo"),
        pytest.param("https:///nohost", id="no-host"),
    ],
)
def test_refused_urls(url: str) -> None:
    msg = refused(url, FetchPolicy())
    assert "pw" not in msg


def test_plain_http_on_loopback_only_with_allow_internal(tmp_path: Path) -> None:
    server = DocServer(tmp_path / "plain", plain=True)
    try:
        url = server.put("/p.json", b"{}")
        assert fetch(url, FetchPolicy(allow_internal=True)).body == b"{}"
        assert "plain http is refused" in refused(url, FetchPolicy())
    finally:
        server.close()


def test_internal_addresses_are_refused_unless_allowed(docs: DocServer) -> None:
    url = docs.put("/a.json", b"{}")
    for u in (url, docs.url("/a.json", host="localhost")):
        assert "non-public address" in refused(u, FetchPolicy(ca_file=docs.ca_file))
    # private and link-local literals likewise
    for host in ("10.0.0.1", "169.254.169.254", "[::1]", "192.168.1.1"):
        assert "non-public address" in refused(f"https://{host}/x", FetchPolicy())


def test_untrusted_certificate_is_refused(docs: DocServer) -> None:
    url = docs.put("/a.json", b"{}")
    assert "TLS certificate not trusted" in refused(url, FetchPolicy(allow_internal=True))
    assert "TLS certificate not trusted" in refused(url, ok_policy(docs, ca_file=docs.other_ca_file))


def test_oversized_is_refused_by_length_and_by_reading(docs: DocServer) -> None:
    assert "more than the 1024 allowed" in refused(docs.behave("/huge", "huge"), ok_policy(docs, max_bytes=1024))
    msg = refused(docs.behave("/chunked", "huge_chunked"), ok_policy(docs, max_bytes=4096))
    assert "more than the 4096 bytes allowed" in msg
    # the bound is inclusive: exactly max_bytes is fine
    assert len(fetch(docs.put("/exact", b"x" * 1024), ok_policy(docs, max_bytes=1024)).body) == 1024


def test_a_server_that_drips_is_cut_at_the_deadline(docs: DocServer) -> None:
    """Each byte comes well within any per-read time-out; only the whole-fetch deadline stops it."""
    msg = refused(docs.behave("/drip", "drip"), ok_policy(docs, timeout_s=0.5))
    assert "not received within 0.5 s" in msg


def test_not_found_is_refused(docs: DocServer) -> None:
    assert "HTTP 404" in refused(docs.url("/missing"), ok_policy(docs))


def test_messages_never_carry_the_query() -> None:
    assert shown("https://h.example/p?key=SECRET#frag") == "https://h.example/p"


def test_data_uris() -> None:
    assert decode_data_uri("data:application/json;base64,e30=", 100) == b"{}"
    assert decode_data_uri("data:application/json,%7B%7D", 100) == b"{}"
    for bad in ("data:application/json;base64,!!!", "data:nocomma"):
        with pytest.raises(UompError):
            decode_data_uri(bad, 100)
    with pytest.raises(UompError, match="more than 4 bytes"):
        decode_data_uri("data:,12345", 4)


# ------------------------------------------------------------------------------ the registration file

REG = "eip155:31337:0x" + "ab" * 20


def test_registration_names_back_only_its_own_agent_and_registry() -> None:
    r = card.parse_registration(registration("A", 7, REG, manifest_url="https://x/uom.json"))
    assert r.names(7, REG) and r.names(7, REG.upper().replace("EIP155", "eip155"))
    assert not r.names(8, REG)
    assert not r.names(7, "eip155:1:0x" + "ab" * 20)
    assert r.uomp() is not None and r.uomp().endpoint == "https://x/uom.json"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        pytest.param({"type": "something-else"}, "type", id="wrong-type"),
        pytest.param({"name": None}, "has no name", id="no-name"),
        pytest.param({"name": "Evil\u202eAgent"}, "bidirectional", id="bidi-name"),
        pytest.param({"registrations": [{"agentId": "7", "agentRegistry": REG}]}, "agentId", id="id-as-string"),
        pytest.param({"registrations": [{"agentId": 7, "agentRegistry": "7:0xab"}]}, "agentRegistry", id="bad-reg"),
        pytest.param({"services": {"name": "UOMP"}}, "services", id="services-not-list"),
        pytest.param({"endpoints": []}, "both", id="services-and-endpoints"),
        pytest.param(
            {"services": [{"name": "UOMP", "endpoint": "https://x", "manifestHash": "0x12"}]},
            "manifestHash",
            id="short-hash",
        ),
        pytest.param(
            {"services": [{"name": "UOMP", "endpoint": "a"}, {"name": "UOMP", "endpoint": "b"}]},
            "more than one UOMP",
            id="two-uomp",
        ),
    ],
)
def test_bad_registration_files(change: dict[str, object], why: str) -> None:
    doc = json.loads(registration("A", 7, REG, manifest_url="https://x/uom.json"))
    doc.update(change)
    with pytest.raises(UompError) as info:
        card.parse_registration(json.dumps(doc).encode())
    assert info.value.code == ErrorCode.REGISTRATION_INVALID
    assert why in info.value.message


def test_not_json_registration() -> None:
    for body in (b"<html>", b"[1]", b"\xff\xfe"):
        with pytest.raises(UompError) as info:
            card.parse_registration(body)
        assert info.value.code == ErrorCode.REGISTRATION_INVALID


def test_registry_ids() -> None:
    assert card.parse_registry_id("31337:0x" + "AB" * 20) == (31337, "0x" + "ab" * 20)
    assert card.parse_registry_id("eip155:1:0x" + "ab" * 20) == (1, "0x" + "ab" * 20)
    for bad in ("0x" + "ab" * 20, "1:0xabc", "eip155:x:0x" + "ab" * 20):
        with pytest.raises(UompError):
            card.parse_registry_id(bad)


# ------------------------------------------------------------------------------ the ABI constants


def test_written_out_selectors_and_topics_are_the_contracts() -> None:
    abi = artifact()["abi"]
    functions = {f"{e['name']}({','.join(i['type'] for i in e['inputs'])})" for e in abi if e["type"] == "function"}
    for signature, sel in chain.SELECTORS.items():
        assert signature in functions
        assert keccak(signature.encode())[:4] == sel
    events = {f"{e['name']}({','.join(i['type'] for i in e['inputs'])})" for e in abi if e["type"] == "event"}
    for signature, top in (
        ("Registered(uint256,string,address)", chain.REGISTERED),
        ("URIUpdated(uint256,string,address)", chain.URI_UPDATED),
        ("Transfer(address,address,uint256)", chain.TRANSFER),
    ):
        assert signature in events
        assert "0x" + keccak(signature.encode()).hex() == top
