"""The agent manifest ``uom.json`` (spec §6), pure; its publisher identity (spec §16) is re-exported.

A little over ~500 lines, one job: the field-by-field validation of ``uom.json`` and its data
model (the publisher-identity check, a second job, is :mod:`gateway.core.publisher`).

:func:`parse_manifest` takes the file's bytes (or an already decoded object) and returns a
frozen :class:`Manifest`, or raises ``UompError(ErrorCode.MANIFEST_INVALID)`` listing EVERY bad field at
once: ``details = {"errors": [{"field", "message"}, ...], "lines": ["agent.id: must be ...", ...]}``.

Spelling: the spec writes snake_case; the TypeScript reference's in-memory types are camelCase.
Every member may be written either way (``deny_tags``/``denyTags``, ``data_retention_policy``/
``dataRetentionPolicy``, …); both spellings of one member at once is an error. Members this
module does not know (``fields``, ``purposes``, ``external_data_sources`` as the reference's
examples carry) are ignored, not refused. ``null`` counts as absent.

Text that the authorization panel shows (names, descriptions, publisher, scope entries) must
not contain control characters or bidirectional-override characters: a manifest must not be
able to repaint the user's terminal or reorder what the user reads.

Retention (§6.5): :func:`retention_level` maps a policy to ``zero`` / ``short`` / ``session`` /
``no_guarantee``; the CLI warns loudly on ``no_guarantee``.

Identity (§16), in :mod:`gateway.core.publisher` (re-exported here): :func:`verify_identity`
verifies one method only, ``did:key`` with an Ed25519 key. The signed bytes are ``canonical_json``
(RFC 8785) of the WHOLE manifest object exactly as decoded, with the single member ``proofValue``
removed from ``identity.proof`` (every other member,
``identity.proof.type``/``created``/``verificationMethod`` included, is signed). The signature is
plain Ed25519 (RFC 8032) over those bytes; ``proofValue`` is either base64url without padding or
multibase base58btc (``z`` prefix), both accepted. This is a UOMP construction that borrows the W3C
proof member names; it is NOT the W3C Data Integrity ``Ed25519Signature2020`` algorithm (which
hashes RDF-canonicalised data). A verified ``did:key`` proves the manifest was signed by the holder
of that key, nothing more: who the key belongs to is the user's trust list (§16.4).

Here every other method (``did:ethr``, ``did:web``, GPG, X.509, registry) is reported as
unverified with the reason ``"method not supported by this verifier: reported as unverified
publisher"``; nothing is ever reported verified that was not checked. did:web, X.509 and OpenPGP
need I/O or the trust list and are checked by :mod:`gateway.identity.verify`, which ``uomp
authorize`` uses. The standard proof is W3C Data Integrity ``eddsa-jcs-2022``
(:mod:`gateway.core.dataintegrity`); the construction above is the legacy one, accepted until
``LEGACY_PROOF_UNTIL`` (:mod:`gateway.core.publisher`).

Longer than ~500 lines on purpose: one document's parser; every field's rule sits with the field.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.core.capability import Scope
from gateway.core.didkey import b58btc_decode as b58btc_decode  # re-exported for callers of this module
from gateway.core.didkey import b58btc_encode as b58btc_encode
from gateway.core.didkey import did_key_from_public as did_key_from_public
from gateway.core.didkey import public_key_from_did_key as public_key_from_did_key
from gateway.core.publisher import DID_PATTERN, MAX_PROOF_VALUE, VERIFICATION_METHODS
from gateway.core.publisher import MAX_DID as MAX_DID
from gateway.core.publisher import PROOF_TYPE as PROOF_TYPE  # re-exported: the publisher identity (§16)
from gateway.core.publisher import UNSUPPORTED_REASON as UNSUPPORTED_REASON
from gateway.core.publisher import IdentityResult as IdentityResult
from gateway.core.publisher import manifest_signing_input as manifest_signing_input
from gateway.core.publisher import sign_manifest as sign_manifest
from gateway.core.publisher import verify_identity as verify_identity
from gateway.core.tokens import parse_iso
from gateway.errors import ErrorCode, UompError

UOMP_VERSION = "1.0"
MAX_MANIFEST_BYTES = 256 * 1024
MAX_ID = 128
MAX_NAME = 200
MAX_DESCRIPTION = 4000
MAX_VERSION = 64
MAX_SCOPE_ITEM = 256
MAX_LIST_ITEMS = 1024
MAX_CAPABILITY = 64
# §6.5 retention levels, in seconds of max_retention_seconds (upper bounds, inclusive).
SHORT_RETENTION_MAX = 600  # "short": discard after each task (the table's 300-600)
SESSION_RETENTION_MAX = 86_400  # "session": kept until the session ends; beyond a day: no guarantee

DELETION_METHODS = ("process_termination", "secure_wipe", "ephemeral_storage")

RetentionLevel = Literal["zero", "short", "session", "no_guarantee"]

_AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_VERSION = re.compile(
    r"[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?(?:\+[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*)?"
)
_CAPABILITY = re.compile(r"[a-z][a-z0-9_-]*(?:\.[a-z][a-z0-9_-]*)*")
# C0 and C1 controls, DEL, the Unicode line/paragraph separators, and the bidirectional
# marks/overrides/isolates ("Trojan Source"). Descriptions may contain \n and \t.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
_UNSAFE_MULTILINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
_MISSING: Any = object()


def is_display_safe(text: str) -> bool:
    """No control or bidirectional-override character: safe to print on one terminal line."""
    return not _UNSAFE.search(text)


# ------------------------------------------------------------------------------ data model


@dataclass(frozen=True)
class AgentInfo:
    """Who the agent says it is (§16.2 ``agent``): id, name, version, publisher."""

    id: str
    name: str
    version: str
    description: str | None = None
    publisher: str | None = None


@dataclass(frozen=True)
class RetentionPolicy:
    """What the agent promises to do with what it reads (§16.2 ``retention``)."""

    max_retention_seconds: float
    deletion_method: str  # one of DELETION_METHODS
    proof_required: bool = False
    third_party_sharing: bool = False
    encryption_at_rest: bool = False
    description: str | None = None


@dataclass(frozen=True)
class IdentityClaim:
    """What the manifest claims about its publisher (unverified: see :func:`verify_identity`)."""

    did: str | None
    verification_methods: tuple[str, ...]
    proof_type: str | None
    proof_created: str | None
    proof_value: str | None


@dataclass(frozen=True)
class Manifest:
    """A parsed and checked agent manifest (§16): the agent, the scopes it asks for and its promises."""

    uomp_version: str
    agent: AgentInfo
    read: Scope
    write: Scope
    read_description: str | None
    write_description: str | None
    required_capabilities: tuple[str, ...]
    optional_capabilities: tuple[str, ...]
    requires_remote: bool
    retention: RetentionPolicy | None
    identity: IdentityClaim | None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


# ------------------------------------------------------------------------------ validation


class _Errors:
    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        self.items.append((path, message))


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _member(obj: Mapping[str, Any], name: str, path: str, errs: _Errors) -> Any:
    """``obj[name]`` under its snake_case or camelCase spelling; _MISSING when absent or null."""
    camel = _camel(name)
    has_snake, has_camel = name in obj, camel != name and camel in obj
    if has_snake and has_camel:
        errs.add(_join(path, name), f"given twice (as {name} and {camel})")
    value = obj[name] if has_snake else obj[camel] if has_camel else None
    return _MISSING if value is None else value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _text(
    value: Any,
    path: str,
    errs: _Errors,
    *,
    required: bool,
    max_len: int,
    multiline: bool = False,
) -> str | None:
    if value is _MISSING:
        if required:
            errs.add(path, "is required")
        return None
    if not isinstance(value, str):
        errs.add(path, "must be a string")
        return None
    if not value.strip():
        errs.add(path, "must not be empty")
        return None
    if len(value) > max_len:
        errs.add(path, f"must be at most {max_len} characters")
        return None
    if (_UNSAFE_MULTILINE if multiline else _UNSAFE).search(value):
        errs.add(path, "must not contain control or bidirectional-override characters")
        return None
    return value


def _bool(value: Any, path: str, errs: _Errors) -> bool:
    if value is _MISSING:
        return False
    if not isinstance(value, bool):
        errs.add(path, "must be true or false")
        return False
    return value


def _object(value: Any, path: str, errs: _Errors, *, required: bool) -> dict[str, Any] | None:
    if value is _MISSING:
        if required:
            errs.add(path, "is required")
        return None
    if not isinstance(value, dict):
        errs.add(path, "must be an object")
        return None
    return value


def _str_list(
    value: Any,
    path: str,
    errs: _Errors,
    *,
    required: bool,
    max_item: int = MAX_SCOPE_ITEM,
    pattern: re.Pattern[str] | None = None,
    pattern_text: str = "",
    choices: tuple[str, ...] | None = None,
) -> tuple[str, ...] | None:
    if value is _MISSING:
        if required:
            errs.add(path, "is required (a list of strings, may be empty)")
        return None
    if not isinstance(value, list):
        errs.add(path, "must be a list of strings")
        return None
    if len(value) > MAX_LIST_ITEMS:
        errs.add(path, f"must have at most {MAX_LIST_ITEMS} items")
        return None
    ok = True
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, str) or not item:
            errs.add(where, "must be a non-empty string")
            ok = False
        elif len(item) > max_item:
            errs.add(where, f"must be at most {max_item} characters")
            ok = False
        elif _UNSAFE.search(item):
            errs.add(where, "must not contain control or bidirectional-override characters")
            ok = False
        elif pattern is not None and not pattern.fullmatch(item):
            errs.add(where, f"must be {pattern_text}")
            ok = False
        elif choices is not None and item not in choices:
            errs.add(where, "must be one of " + ", ".join(choices))
            ok = False
    return tuple(value) if ok else None


def _scope(value: Any, path: str, errs: _Errors) -> tuple[Scope, str | None]:
    obj = _object(value, path, errs, required=False)
    if obj is None:
        return Scope(), None
    tags = _str_list(_member(obj, "tags", path, errs), _join(path, "tags"), errs, required=True)
    keys = _str_list(_member(obj, "keys", path, errs), _join(path, "keys"), errs, required=True)
    deny_tags = _str_list(_member(obj, "deny_tags", path, errs), _join(path, "deny_tags"), errs, required=False)
    deny_keys = _str_list(_member(obj, "deny_keys", path, errs), _join(path, "deny_keys"), errs, required=False)
    allowed = _str_list(_member(obj, "allowed_fields", path, errs), _join(path, "allowed_fields"), errs, required=False)
    description = _text(
        _member(obj, "description", path, errs),
        _join(path, "description"),
        errs,
        required=False,
        max_len=MAX_DESCRIPTION,
        multiline=True,
    )
    scope = Scope(
        tags=tags or (),
        keys=keys or (),
        deny_tags=deny_tags or (),
        deny_keys=deny_keys or (),
        allowed_fields=allowed,
    )
    return scope, description


def _agent(obj: dict[str, Any], errs: _Errors) -> AgentInfo:
    p = "agent"
    agent_id = _member(obj, "id", p, errs)
    if agent_id is _MISSING:
        errs.add("agent.id", "is required")
    elif not isinstance(agent_id, str) or not _AGENT_ID.fullmatch(agent_id):
        errs.add("agent.id", "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit")
        agent_id = None
    name = _text(_member(obj, "name", p, errs), "agent.name", errs, required=True, max_len=MAX_NAME)
    version = _member(obj, "version", p, errs)
    if version is _MISSING:
        errs.add("agent.version", "is required")
    elif not isinstance(version, str) or len(version) > MAX_VERSION or not _VERSION.fullmatch(version):
        errs.add("agent.version", "must be a semantic version such as 1.2.0 (MAJOR.MINOR.PATCH)")
        version = None
    description = _text(
        _member(obj, "description", p, errs),
        "agent.description",
        errs,
        required=False,
        max_len=MAX_DESCRIPTION,
        multiline=True,
    )
    publisher = _text(_member(obj, "publisher", p, errs), "agent.publisher", errs, required=False, max_len=MAX_NAME)
    return AgentInfo(
        id=agent_id if isinstance(agent_id, str) else "",
        name=name or "",
        version=version if isinstance(version, str) else "",
        description=description,
        publisher=publisher,
    )


def _retention(value: Any, errs: _Errors) -> RetentionPolicy | None:
    p = "data_retention_policy"
    obj = _object(value, p, errs, required=False)
    if obj is None:
        return None
    seconds = _member(obj, "max_retention_seconds", p, errs)
    max_seconds = 0.0
    if seconds is _MISSING:
        errs.add(f"{p}.max_retention_seconds", "is required")
    elif isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds < 0:
        errs.add(f"{p}.max_retention_seconds", "must be a number of seconds >= 0")
    else:
        max_seconds = float(seconds)
    method = _member(obj, "deletion_method", p, errs)
    if method is _MISSING:
        errs.add(f"{p}.deletion_method", "is required")
    elif method not in DELETION_METHODS:
        errs.add(f"{p}.deletion_method", "must be one of " + ", ".join(DELETION_METHODS))
    return RetentionPolicy(
        max_retention_seconds=max_seconds,
        deletion_method=method if method in DELETION_METHODS else "",
        proof_required=_bool(_member(obj, "proof_required", p, errs), f"{p}.proof_required", errs),
        third_party_sharing=_bool(_member(obj, "third_party_sharing", p, errs), f"{p}.third_party_sharing", errs),
        encryption_at_rest=_bool(_member(obj, "encryption_at_rest", p, errs), f"{p}.encryption_at_rest", errs),
        description=_text(
            _member(obj, "description", p, errs),
            f"{p}.description",
            errs,
            required=False,
            max_len=MAX_DESCRIPTION,
            multiline=True,
        ),
    )


def _identity(value: Any, errs: _Errors) -> IdentityClaim | None:
    p = "identity"
    obj = _object(value, p, errs, required=False)
    if obj is None:
        return None
    did = _member(obj, "did", p, errs)
    if did is _MISSING:
        did = None
    elif not isinstance(did, str) or len(did) > MAX_DID or not DID_PATTERN.fullmatch(did):
        errs.add("identity.did", "must be a DID (did:<method>:<identifier>)")
        did = None
    methods = _str_list(
        _member(obj, "verification_methods", p, errs),
        "identity.verification_methods",
        errs,
        required=False,
        choices=VERIFICATION_METHODS,
    )
    proof = _object(_member(obj, "proof", p, errs), "identity.proof", errs, required=False)
    proof_type = created = proof_value = None
    if proof is not None:
        pp = "identity.proof"
        proof_type = _text(_member(proof, "type", pp, errs), f"{pp}.type", errs, required=True, max_len=128)
        created = _text(_member(proof, "created", pp, errs), f"{pp}.created", errs, required=False, max_len=64)
        if created is not None:
            try:
                parse_iso(created)
            except (ValueError, OverflowError):
                errs.add(f"{pp}.created", "must be an ISO 8601 timestamp")
                created = None
        proof_value = _text(
            _member(proof, "proof_value", pp, errs),
            f"{pp}.proofValue",
            errs,
            required=True,
            max_len=MAX_PROOF_VALUE,
        )
    return IdentityClaim(
        did=did,
        verification_methods=methods or (),
        proof_type=proof_type,
        proof_created=created,
        proof_value=proof_value,
    )


class _DuplicateMember(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateMember(ascii(key)[:80])
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _invalid(items: list[tuple[str, str]]) -> UompError:
    n = len(items)
    lines = [f"{f}: {m}" for f, m in items]
    return UompError(
        ErrorCode.MANIFEST_INVALID,
        f"uom.json is invalid: {n} problem{'s' if n != 1 else ''}",
        details={"errors": [{"field": f, "message": m} for f, m in items], "lines": lines},
    )


def _decode(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MANIFEST_BYTES:
        raise _invalid([("$", f"file is larger than {MAX_MANIFEST_BYTES} bytes")])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _invalid([("$", "file is not UTF-8")]) from exc
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _DuplicateMember as exc:
        raise _invalid([("$", f"duplicate member name {exc}")]) from exc
    except json.JSONDecodeError as exc:
        raise _invalid([("$", f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})")]) from exc
    except (ValueError, RecursionError) as exc:
        raise _invalid([("$", "not valid JSON")]) from exc
    if not isinstance(obj, dict):
        raise _invalid([("$", "must be a JSON object")])
    return obj


def parse_manifest(data: bytes | dict[str, Any]) -> Manifest:
    """Validate ``uom.json`` (bytes of the file, or the decoded object) into a :class:`Manifest`.

    Raises ``UompError(ErrorCode.MANIFEST_INVALID)`` listing every problem found (see module docstring).
    Does not verify the identity proof: that is :func:`verify_identity`.
    """
    if isinstance(data, bytes | bytearray):
        raw = _decode(bytes(data))
    elif isinstance(data, dict):
        raw = copy.deepcopy(data)
    else:
        raise _invalid([("$", "must be a JSON object")])
    errs = _Errors()

    version = _member(raw, "uomp_version", "", errs)
    if version is _MISSING:
        errs.add("uomp_version", 'is required ("1.0")')
    elif version != UOMP_VERSION:
        errs.add("uomp_version", 'must be "1.0"')

    agent_obj = _object(_member(raw, "agent", "", errs), "agent", errs, required=True)
    agent = _agent(agent_obj, errs) if agent_obj is not None else AgentInfo("", "", "")

    scopes = _object(_member(raw, "requested_scopes", "", errs), "requested_scopes", errs, required=True)
    read, read_desc = Scope(), None
    write, write_desc = Scope(), None
    if scopes is not None:
        read, read_desc = _scope(_member(scopes, "read", "requested_scopes", errs), "requested_scopes.read", errs)
        write, write_desc = _scope(_member(scopes, "write", "requested_scopes", errs), "requested_scopes.write", errs)

    caps: dict[str, tuple[str, ...]] = {}
    for name in ("required_capabilities", "optional_capabilities"):
        caps[name] = (
            _str_list(
                _member(raw, name, "", errs),
                name,
                errs,
                required=False,
                max_item=MAX_CAPABILITY,
                pattern=_CAPABILITY,
                pattern_text="a capability name such as memory.read",
            )
            or ()
        )
    both = sorted(set(caps["required_capabilities"]) & set(caps["optional_capabilities"]))
    if both:
        errs.add("optional_capabilities", "must not repeat a required capability: " + ", ".join(both))

    requires_remote = _bool(_member(raw, "requires_remote", "", errs), "requires_remote", errs)
    retention = _retention(_member(raw, "data_retention_policy", "", errs), errs)
    identity = _identity(_member(raw, "identity", "", errs), errs)

    if errs.items:
        raise _invalid(errs.items)
    return Manifest(
        uomp_version=UOMP_VERSION,
        agent=agent,
        read=read,
        write=write,
        read_description=read_desc,
        write_description=write_desc,
        required_capabilities=caps["required_capabilities"],
        optional_capabilities=caps["optional_capabilities"],
        requires_remote=requires_remote,
        retention=retention,
        identity=identity,
        raw=raw,
    )


def retention_level(policy: RetentionPolicy | None) -> RetentionLevel:
    """The §6.5 retention level. No policy, or more than a day of retention: ``no_guarantee``.

    ``0`` seconds is ``zero`` whatever the method (secure_wipe/ephemeral_storage are only
    stronger); up to 600 s ``short``; up to 86 400 s ``session``.
    """
    if policy is None:
        return "no_guarantee"
    seconds = policy.max_retention_seconds
    if seconds == 0:
        return "zero"
    if seconds <= SHORT_RETENTION_MAX:
        return "short"
    if seconds <= SESSION_RETENTION_MAX:
        return "session"
    return "no_guarantee"
