"""RFC 8785 canonicalisation: the RFC's own examples (§3.2.2, §3.2.3, Appendix B numbers)."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as _st

from gateway.core import canonical as _canonical
from gateway.core.canonical import canonical_json
from gateway.errors import UompError


def _double(hex_bits: str) -> float:
    value: float = struct.unpack(">d", bytes.fromhex(hex_bits))[0]
    return value


# RFC 8785 Appendix B: IEEE 754 bit patterns and their canonical serialisation.
NUMBER_VECTORS = [
    ("0000000000000000", "0"),
    ("8000000000000000", "0"),  # minus zero
    ("0000000000000001", "5e-324"),
    ("8000000000000001", "-5e-324"),
    ("7fefffffffffffff", "1.7976931348623157e+308"),
    ("ffefffffffffffff", "-1.7976931348623157e+308"),
    ("4340000000000000", "9007199254740992"),
    ("c340000000000000", "-9007199254740992"),
    ("4430000000000000", "295147905179352830000"),
    ("44b52d02c7e14af5", "9.999999999999997e+22"),
    ("44b52d02c7e14af6", "1e+23"),
    ("44b52d02c7e14af7", "1.0000000000000001e+23"),
    ("444b1ae4d6e2ef4e", "999999999999999700000"),
    ("444b1ae4d6e2ef4f", "999999999999999900000"),
    ("444b1ae4d6e2ef50", "1e+21"),
    ("3eb0c6f7a0b5ed8c", "9.999999999999997e-7"),
    ("3eb0c6f7a0b5ed8d", "0.000001"),
    ("41b3de4355555553", "333333333.3333332"),
    ("41b3de4355555554", "333333333.33333325"),
    ("41b3de4355555555", "333333333.3333333"),
    ("41b3de4355555556", "333333333.3333334"),
    ("41b3de4355555557", "333333333.33333343"),
    ("becbf647612f3696", "-0.0000033333333333333333"),
    ("43143ff3c1cb0959", "1424953923781206.2"),
]


@pytest.mark.parametrize(("bits", "expected"), NUMBER_VECTORS, ids=[b for b, _ in NUMBER_VECTORS])
def test_number_serialisation(bits: str, expected: str) -> None:
    assert canonical_json(_double(bits)) == expected.encode("ascii")


@pytest.mark.parametrize("bits", ["7fffffffffffffff", "7ff0000000000000", "fff0000000000000"])
def test_nan_and_infinity_are_refused(bits: str) -> None:
    assert not math.isfinite(_double(bits))
    with pytest.raises(UompError) as e:
        canonical_json(_double(bits))
    assert e.value.code == "INVALID_REQUEST"


def test_rfc_section_3_2_2_example() -> None:
    text = (
        '{"numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],'
        r' "string": "\u20ac$\u000F\u000aA' + "'" + r'\u0042\u0022\u005c\\\"\/",'
        ' "literals": [null, true, false]}'
    )
    expected = (
        '{"literals":[null,true,false],'
        '"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"\u20ac$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical_json(json.loads(text)) == expected.encode("utf-8")


def test_rfc_section_3_2_3_sorting_by_utf16_code_units() -> None:
    obj = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    out = json.loads(canonical_json(obj))
    # The emoji (UTF-16 D83D DE00) sorts before U+FB33, unlike a code-point sort.
    assert list(out.values()) == [
        "Carriage Return",
        "One",
        "Control",
        "Latin Small Letter O With Diaeresis",
        "Euro Sign",
        "Emoji: Grinning Face",
        "Hebrew Letter Dalet With Dagesh",
    ]


def test_nested_objects_are_sorted_and_compact() -> None:
    assert canonical_json({"b": [1, {"z": 1, "a": True}], "a": None}) == b'{"a":null,"b":[1,{"a":true,"z":1}]}'


def test_non_ascii_is_emitted_as_utf8_not_escaped() -> None:
    assert canonical_json({"k": "é😀"}) == '{"k":"é😀"}'.encode()


REFUSED: list[tuple[str, Any]] = [
    ("int beyond 2**53", 2**53),
    ("negative int beyond 2**53", -(2**53)),
    ("lone surrogate in value", "\ud800"),
    ("lone surrogate in name", {"\udc00": 1}),
    ("non-string key", {1: "x"}),
    ("bytes", b"x"),
    ("set", {1, 2}),
    ("nan", float("nan")),
]


@pytest.mark.parametrize(("name", "value"), REFUSED, ids=[n for n, _ in REFUSED])
def test_values_without_canonical_form_are_invalid_request(name: str, value: Any) -> None:
    with pytest.raises(UompError) as e:
        canonical_json(value)
    assert e.value.code == "INVALID_REQUEST"


def test_deep_nesting_is_invalid_request_not_recursion_error() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UompError) as e:
        canonical_json(deep)
    assert e.value.code == "INVALID_REQUEST"


# The fast path must give rfc8785's bytes for every value it accepts (and it accepts most events).

_json = _st.recursive(
    _st.none()
    | _st.booleans()
    | _st.integers(-(2**53) + 1, 2**53 - 1)
    | _st.floats(allow_nan=False, allow_infinity=False)
    | _st.text(),
    lambda inner: _st.lists(inner, max_size=5) | _st.dictionaries(_st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(_json)
def test_fast_path_matches_rfc8785(value: object) -> None:
    try:
        want = rfc8785.dumps(value)
    except Exception:
        with pytest.raises(UompError):
            canonical_json(value)
        return
    assert canonical_json(value) == want


@pytest.mark.parametrize(
    "value",
    [
        {"ts": 1790000000.123, "a": "é\u2028\x07", "n": None, "b": True, "l": [1, -2, 0.5]},
        {"control": '\x00\x1f\x7f"\\/', "tab": "\t\n\r\b\f"},
    ],
    ids=["event-like", "escapes"],
)
def test_fast_path_taken_and_identical(value: dict[str, object]) -> None:
    assert _canonical._fast_ok(value)
    assert canonical_json(value) == rfc8785.dumps(value)
