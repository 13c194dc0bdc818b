"""Request-target normalisation: accepted spellings and the attack table (every refusal is
INVALID_REQUEST, with the rule that refused it)."""

from __future__ import annotations

import pytest

from gateway.errors import UompError
from gateway.remote.pathnorm import MAX_PATH_LENGTH, MAX_QUERY_LENGTH, Target, normalize_target

# name, raw target, expected path, expected upstream path, expected query
ACCEPTED = [
    ("plain", "/v1/memory/a.b", "/v1/memory/a.b", "/v1/memory/a.b", ""),
    ("root", "/", "/", "/", ""),
    ("health", "/v1/health", "/v1/health", "/v1/health", ""),
    ("unreserved escaped", "/v1/memory/%61", "/v1/memory/a", "/v1/memory/a", ""),
    ("lowercase hex", "/v1/memory/%7e%5f", "/v1/memory/~_", "/v1/memory/~_", ""),
    ("space escaped", "/v1/memory/a%20b", "/v1/memory/a b", "/v1/memory/a%20b", ""),
    (
        "sub-delims kept",
        "/v1/memory/a:b@c!$&'()*+,;=",
        "/v1/memory/a:b@c!$&'()*+,;=",
        "/v1/memory/a:b@c!$&'()*+,;=",
        "",
    ),
    ("escaped sub-delim unescaped upstream", "/v1/memory/a%3Ab", "/v1/memory/a:b", "/v1/memory/a:b", ""),
    ("unicode key", "/v1/memory/caf%C3%A9", "/v1/memory/café", "/v1/memory/caf%C3%A9", ""),
    ("unicode key lowercase hex", "/v1/memory/caf%c3%a9", "/v1/memory/café", "/v1/memory/caf%C3%A9", ""),
    ("cjk key", "/v1/memory/%E8%AE%B0%E5%BF%86", "/v1/memory/记忆", "/v1/memory/%E8%AE%B0%E5%BF%86", ""),
    ("emoji key", "/v1/memory/%F0%9F%98%80", "/v1/memory/😀", "/v1/memory/%F0%9F%98%80", ""),
    ("three dots is a name", "/v1/memory/...", "/v1/memory/...", "/v1/memory/...", ""),
    ("dot inside name", "/v1/memory/..a", "/v1/memory/..a", "/v1/memory/..a", ""),
    ("query", "/v1/memory?tag=work", "/v1/memory", "/v1/memory", "tag=work"),
    (
        "query two params",
        "/v1/memory/aggregate?tag=a&op=count",
        "/v1/memory/aggregate",
        "/v1/memory/aggregate",
        "tag=a&op=count",
    ),
    ("query escapes kept raw", "/v1/memory?tag=caf%C3%A9+x", "/v1/memory", "/v1/memory", "tag=caf%C3%A9+x"),
    ("query literal percent allowed", "/v1/memory?tag=100%25", "/v1/memory", "/v1/memory", "tag=100%25"),
    ("query slash and question mark", "/v1/memory?tag=a/b?c", "/v1/memory", "/v1/memory", "tag=a/b?c"),
    ("empty query", "/v1/health?", "/v1/health", "/v1/health", ""),
]


@pytest.mark.parametrize(("name", "raw", "path", "upstream", "query"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted(name: str, raw: str, path: str, upstream: str, query: str) -> None:
    t = normalize_target(raw)
    assert isinstance(t, Target)
    assert t.path == path
    assert t.upstream_path == upstream
    assert t.query == query
    expected_segments = () if path == "/" else tuple(path.split("/")[1:])
    assert t.segments == expected_segments


# name, raw target, rule
REFUSED = [
    # form of the target
    ("empty", "", "origin"),
    ("asterisk form", "*", "origin"),
    ("absolute form", "http://evil/v1/memory/x", "origin"),
    ("absolute form https", "https://evil/v1/memory/x", "origin"),
    ("authority form", "evil:443", "origin"),
    ("relative", "v1/memory/x", "origin"),
    ("fragment", "/v1/memory/x#frag", "fragment"),
    ("fragment in query", "/v1/memory?tag=a#b", "fragment"),
    # dot segments, raw and encoded
    ("dotdot raw", "/v1/../v1/sessions", "dot_segment"),
    ("dotdot last", "/v1/memory/..", "dot_segment"),
    ("dot raw", "/v1/./memory", "dot_segment"),
    ("dotdot encoded", "/v1/memory/%2e%2e", "dot_segment"),
    ("dotdot encoded upper then more", "/v1/memory/%2E%2E/x", "dot_segment"),
    ("dotdot half encoded", "/v1/memory/.%2e", "dot_segment"),
    ("dot encoded", "/v1/%2e/memory", "dot_segment"),
    # separators smuggled in
    ("encoded slash", "/v1/memory/a%2Fb", "encoded_slash"),
    ("encoded slash lowercase", "/v1/memory/a%2fb", "encoded_slash"),
    ("encoded backslash", "/v1/memory/%5c", "encoded_backslash"),
    ("encoded backslash upper", "/v1/memory/a%5Cb", "encoded_backslash"),
    ("raw backslash", "/v1/memory/a\\b", "backslash"),
    ("raw backslash dotdot", "/v1/memory\\..\\sessions", "backslash"),
    # double encoding
    ("double encoded slash", "/v1/memory/a%252Fb", "double_encoding"),
    ("double encoded dot", "/v1/memory/%252e%252e", "double_encoding"),
    ("encoded percent", "/v1/memory/100%25", "double_encoding"),
    # empty segments
    ("leading double slash", "//v1/memory", "empty_segment"),
    ("inner double slash", "/v1//memory", "empty_segment"),
    ("trailing slash", "/v1/memory/", "empty_segment"),
    ("only slashes", "///", "empty_segment"),
    # control characters
    ("encoded nul", "/v1/memory/a%00", "control"),
    ("encoded newline", "/v1/memory/a%0Ab", "control"),
    ("encoded cr", "/v1/memory/a%0db", "control"),
    ("encoded del", "/v1/memory/a%7F", "control"),
    ("encoded c1 control", "/v1/memory/a%C2%85", "control"),
    ("raw nul", "/v1/memory/a\x00", "control"),
    ("raw tab", "/v1/memory/a\tb", "control"),
    ("raw newline", "/v1/memory/a\nb", "control"),
    ("raw del", "/v1/memory/a\x7f", "control"),
    # characters
    ("raw space", "/v1/memory/a b", "character"),
    ("raw quote", '/v1/memory/a"b', "character"),
    ("raw angle", "/v1/memory/<script>", "character"),
    ("raw pipe", "/v1/memory/a|b", "character"),
    ("raw non ascii", "/v1/memory/café", "non_ascii"),
    # percent escapes
    ("bad escape", "/v1/memory/%zz", "percent"),
    ("truncated escape", "/v1/memory/a%2", "percent"),
    ("bare percent", "/v1/memory/%", "percent"),
    ("half hex", "/v1/memory/%g0", "percent"),
    # UTF-8
    ("bad utf8", "/v1/memory/%c3%28", "utf8"),
    ("lone continuation", "/v1/memory/%80", "utf8"),
    ("overlong slash", "/v1/memory/%C0%AF", "utf8"),
    ("overlong dot", "/v1/memory/%C0%AE%C0%AE", "utf8"),
    ("encoded surrogate", "/v1/memory/%ED%A0%80", "utf8"),
    ("truncated sequence", "/v1/memory/%E8%AE", "utf8"),
    # length
    ("path too long", "/" + "a" * MAX_PATH_LENGTH, "length"),
    ("query too long", "/v1/memory?tag=" + "a" * MAX_QUERY_LENGTH, "length"),
    ("target too long", "/" + "a" * 10_000, "length"),
    # query
    ("query encoded nul", "/v1/memory?tag=a%00", "control"),
    ("query encoded newline", "/v1/memory?tag=a%0d%0aX-Injected:1", "control"),
    ("query raw tab", "/v1/memory?tag=a\tb", "control"),
    ("query raw backslash", "/v1/memory?tag=a\\b", "backslash"),
    ("query encoded backslash", "/v1/memory?tag=a%5Cb", "encoded_backslash"),
    ("query bad escape", "/v1/memory?tag=%zz", "percent"),
    ("query bad utf8", "/v1/memory?tag=%c3%28", "utf8"),
    ("query raw space", "/v1/memory?tag=a b", "character"),
    ("query non ascii", "/v1/memory?tag=é", "non_ascii"),
]


@pytest.mark.parametrize(("name", "raw", "rule"), REFUSED, ids=[c[0] for c in REFUSED])
def test_refused(name: str, raw: str, rule: str) -> None:
    with pytest.raises(UompError) as exc:
        normalize_target(raw)
    assert exc.value.code == "INVALID_REQUEST"
    assert exc.value.status == 400
    assert exc.value.details == {"rule": rule}


def test_refusal_message_never_echoes_the_target() -> None:
    secret_key = "very-private-key-name"
    for raw in (
        f"/v1/memory/{secret_key}%2Fx",
        f"/v1/memory/{secret_key}/..",
        f"/v1/memory/{secret_key}%zz",
        f"/v1/memory/{secret_key}?tag=%00",
    ):
        with pytest.raises(UompError) as exc:
            normalize_target(raw)
        assert secret_key not in str(exc.value)
        assert secret_key not in repr(exc.value.body())


def test_limits_are_inclusive() -> None:
    path = "/" + "a" * (MAX_PATH_LENGTH - 1)
    query = "q=" + "b" * (MAX_QUERY_LENGTH - 2)
    t = normalize_target(f"{path}?{query}")
    assert t.path == path
    assert t.query == query


def test_upstream_target() -> None:
    assert normalize_target("/v1/memory?tag=a").upstream_target == "/v1/memory?tag=a"
    assert normalize_target("/v1/memory/%61").upstream_target == "/v1/memory/a"


def test_segments_keep_reserved_characters_decoded() -> None:
    t = normalize_target("/v1/memory/a%3Bb/c%40d")
    assert t.segments == ("v1", "memory", "a;b", "c@d")
    assert t.upstream_path == "/v1/memory/a;b/c@d"


@pytest.mark.parametrize("raw", [c[1] for c in ACCEPTED])
def test_upstream_spelling_is_a_fixed_point(raw: str) -> None:
    """Normalising what we send upstream gives back the same path and the same spelling: the guard,
    decoding once, reads exactly what the gateway checked."""
    t = normalize_target(raw)
    again = normalize_target(t.upstream_target)
    assert again.path == t.path
    assert again.upstream_path == t.upstream_path
    assert again.segments == t.segments


def test_all_spellings_of_a_key_meet_in_one() -> None:
    spellings = ["/v1/memory/ab", "/v1/memory/%61b", "/v1/memory/a%62", "/v1/memory/%61%62", "/v1/memory/%61%62"]
    assert {normalize_target(s).upstream_path for s in spellings} == {"/v1/memory/ab"}
