"""The MCP tools of ``uomp mcp serve``: their exact input schemas, the check of every call's arguments
against them, and each tool as one call of the agent SDK (:class:`gateway.client.UompClient`).

Nothing here knows more than the agent's own bundle: every read goes through the gateway (or the
Local Profile), which decides what is granted; a refusal comes back as the SDK's error and becomes
an MCP tool error (``isError``) that carries the stable code and the one-line reason.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ed25519

from gateway.client import UompClient, memory_hash
from gateway.client.errors import ConfigError, InvalidRequest
from gateway.client.options import AGGREGATE_OPS, JSONObject
from gateway.core.manifest import DELETION_METHODS

MAX_KEY = 512
MAX_TAG = 256
MAX_CURSOR = 4096
MAX_PAGE = 100
MAX_AUDIT = 1000
MAX_EVENT_ID = 128
MAX_FIELD = 256
MAX_PAYLOAD_CHARS = 1024 * 1024  # one upload through a tool call (sealed into the JSON envelope)
MAX_FIELDS_ACCESSED = 64
MEMORY_HASH = r"^sha256:[0-9a-f]{64}$"


def _str(description: str, max_len: int, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_len, "description": description, **extra}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One MCP tool: its name, title, description and exact input schema."""

    name: str
    title: str
    description: str
    input_schema: dict[str, Any]
    read_only: bool = True


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "memory_read",
        "Read one memory item",
        "Read one item of the user's memory by its key. Only keys the user granted are answered; "
        "fields the grant hides are left out.",
        _object({"key": _str("the item's key, e.g. preference.theme", MAX_KEY)}, ("key",)),
    ),
    ToolSpec(
        "memory_list",
        "List memory items by tag",
        "List the granted items that carry a tag, one page at a time. Pass the answer's next_cursor "
        "as cursor to get the next page; next_cursor is null after the last page. Each page is one "
        "read query of the grant's quota.",
        _object(
            {
                "tag": _str("the tag, e.g. preference", MAX_TAG),
                "cursor": _str("next_cursor from the previous page", MAX_CURSOR),
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_PAGE,
                    "description": "items per page (the gateway's default when absent)",
                },
            },
            ("tag",),
        ),
    ),
    ToolSpec(
        "memory_aggregate",
        "Aggregate memory items",
        "Count the granted items with a tag, or sum / average / min / max one numeric field of their "
        "values (field value.NAME). Never returns the items themselves.",
        _object(
            {
                "tag": _str("the tag whose items are aggregated", MAX_TAG),
                "op": {"type": "string", "enum": list(AGGREGATE_OPS), "description": "the aggregate"},
                "field": _str("the numeric field, e.g. value.market_value (not for count)", MAX_FIELD),
            },
            ("tag", "op"),
        ),
    ),
    ToolSpec(
        "grant_describe",
        "Describe this grant",
        "What this agent may read, in words: granted tags and keys, what is excluded, field limits, "
        "the read quota, when the session ends and what the user asked about retention.",
        _object({}),
    ),
    ToolSpec(
        "audit_events",
        "This session's audit events",
        "This session's own audit trail (newest first): what it asked for and what it got.",
        _object({"limit": {"type": "integer", "minimum": 1, "maximum": MAX_AUDIT, "description": "at most this many"}}),
    ),
    ToolSpec(
        "audit_proof",
        "Proof of one audit event",
        "The signed inclusion proof of one of this session's allowed audit events (checked here "
        "against the audit key in the bundle before it is returned).",
        _object({"event_id": _str("the event's id (from audit_events)", MAX_EVENT_ID)}, ("event_id",)),
    ),
    ToolSpec(
        "payload_upload",
        "Send the user an encrypted result",
        "Seal a result to the user's payload key on this machine and upload it; only the user can open "
        "it (uomp payload pull). The plaintext never leaves this process. Returns the payload_id.",
        _object(
            {
                "content": {
                    "type": "string",
                    "maxLength": MAX_PAYLOAD_CHARS,
                    "description": "the result: text, or base64 when encoding is base64",
                },
                "format": _str("its media type", 128, default="text/plain"),
                "encoding": {"type": "string", "enum": ["utf-8", "base64"], "default": "utf-8"},
            },
            ("content",),
        ),
        read_only=False,
    ),
    ToolSpec(
        "deletion_proof_submit",
        "Submit a signed deletion proof",
        "Tell the user, signed with the agent's identity key, that what this session read was deleted "
        "(spec §19). memory_hash defaults to the hash of the items read through this server.",
        _object(
            {
                "method": {
                    "type": "string",
                    "enum": list(DELETION_METHODS),
                    "description": "the manifest's deletion_method (default: the server's --deletion-method)",
                },
                "memory_hash": {"type": "string", "pattern": MEMORY_HASH, "description": "sha256:<64 hex>"},
                "fields_accessed": {
                    "type": "array",
                    "maxItems": MAX_FIELDS_ACCESSED,
                    "items": _str("a field name", MAX_FIELD),
                },
            }
        ),
        read_only=False,
    ),
    ToolSpec(
        "session_end",
        "End this session",
        "Close this session now: its tokens stop working at once and every later call is refused. "
        "Submit a deletion proof first if one is due.",
        _object({}),
        read_only=False,
    ),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)
_SPECS = {t.name: t for t in TOOLS}


class ArgumentError(ValueError):
    """A tool call whose arguments do not fit the tool's input schema."""


def check_arguments(name: str, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    """``arguments`` checked against the tool's input schema (the subset of JSON Schema used above:
    object, required, additionalProperties false, string length / enum / pattern, integer bounds,
    arrays of strings); defaults filled in."""
    spec = _SPECS.get(name)
    if spec is None:
        raise ArgumentError(f"no tool named {name[:64]!r}; the tools are {', '.join(TOOL_NAMES)}")
    args = dict(arguments or {})
    schema = spec.input_schema
    props: dict[str, Any] = schema["properties"]
    extra = sorted(set(args) - set(props))
    if extra:
        raise ArgumentError(f"{name} takes no argument {extra[0][:64]!r}; it takes: {', '.join(props) or 'nothing'}")
    for req in schema["required"]:
        if req not in args:
            raise ArgumentError(f"{name} needs the argument {req!r}")
    for key, value in list(args.items()):
        _check_value(f"{name}.{key}", props[key], value)
    for key, prop in props.items():
        if key not in args and "default" in prop:
            args[key] = prop["default"]
    return args


def _check_value(where: str, prop: Mapping[str, Any], value: Any) -> None:
    kind = prop["type"]
    if kind == "string":
        if not isinstance(value, str):
            raise ArgumentError(f"{where} must be a string")
        if len(value) < prop.get("minLength", 0) or len(value) > prop.get("maxLength", MAX_PAYLOAD_CHARS):
            raise ArgumentError(f"{where} must be {prop.get('minLength', 0)} to {prop.get('maxLength')} characters")
        if "enum" in prop and value not in prop["enum"]:
            raise ArgumentError(f"{where} must be one of {', '.join(prop['enum'])}")
        if "pattern" in prop and not re.fullmatch(prop["pattern"].strip("^$"), value):
            raise ArgumentError(f"{where} must match {prop['pattern']}")
    elif kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentError(f"{where} must be an integer")
        if not prop["minimum"] <= value <= prop["maximum"]:
            raise ArgumentError(f"{where} must be between {prop['minimum']} and {prop['maximum']}")
    elif kind == "array":
        if not isinstance(value, list) or len(value) > prop["maxItems"]:
            raise ArgumentError(f"{where} must be a list of at most {prop['maxItems']} items")
        for item in value:
            _check_value(where + "[]", prop["items"], item)
    else:  # pragma: no cover - every schema above uses the kinds handled here
        raise ArgumentError(f"{where} has an unknown type")


# ---------------------------------------------------------------------------- the tools


@dataclasses.dataclass
class Agent:
    """What one ``uomp mcp serve`` process holds: the SDK client of its bundle, the identity key for
    deletion proofs (optional) and the items it returned (their hash is the default memory_hash)."""

    client: UompClient
    identity_key: ed25519.Ed25519PrivateKey | None = None
    deletion_method: str = "process_termination"
    read: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def remember(self, items: list[JSONObject]) -> None:
        for item in items:
            key = item.get("key")
            if isinstance(key, str):
                self.read[key] = item.get("value")

    async def call(self, name: str, args: dict[str, Any]) -> JSONObject:
        handler: Callable[[Agent, dict[str, Any]], Awaitable[JSONObject]] = _HANDLERS[name]
        return await handler(self, args)

    async def grant(self) -> JSONObject:
        session = await self.client.session()
        claims = self.client.token_claims()
        return {"session": session, "token": _token_facts(claims), "words": describe(session, claims)}

    def granted_tags(self) -> list[str]:
        claims = self.client.token_claims()
        scope = (claims.get("scopes") or {}).get("read") or {}
        tags = scope.get("tags") if isinstance(scope, dict) else None
        return [t for t in tags if isinstance(t, str)] if isinstance(tags, list) else []


async def _read(agent: Agent, args: dict[str, Any]) -> JSONObject:
    item = await agent.client.get(args["key"])
    agent.remember([item])
    return item


async def _list(agent: Agent, args: dict[str, Any]) -> JSONObject:
    items, nxt = await agent.client.by_tag_page(args["tag"], cursor=args.get("cursor"), limit=args.get("limit"))
    agent.remember(items)
    return {"items": items, "next_cursor": nxt}


async def _aggregate(agent: Agent, args: dict[str, Any]) -> JSONObject:
    return await agent.client.aggregate(args["tag"], args["op"], args.get("field"))


async def _grant(agent: Agent, args: dict[str, Any]) -> JSONObject:
    return await agent.grant()


async def _audit(agent: Agent, args: dict[str, Any]) -> JSONObject:
    return {"events": await agent.client.audit(limit=args.get("limit"))}


async def _proof(agent: Agent, args: dict[str, Any]) -> JSONObject:
    return await agent.client.audit_proof(args["event_id"])


async def _upload(agent: Agent, args: dict[str, Any]) -> JSONObject:
    if args["encoding"] == "base64":
        try:
            data = base64.b64decode(args["content"], validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest("INVALID_REQUEST", "content is not valid base64; send it as encoding utf-8") from None
    else:
        data = args["content"].encode()
    try:
        payload_id = await agent.client.upload_payload(data, format=args["format"])
    except ValueError as exc:  # the media type
        raise InvalidRequest("INVALID_REQUEST", f"{exc}") from None
    return {"payload_id": payload_id, "format": args["format"], "bytes": len(data), "sealed": True}


async def _deletion(agent: Agent, args: dict[str, Any]) -> JSONObject:
    if agent.identity_key is None:
        raise ConfigError(
            "CONFIG_ERROR",
            "no identity key: start uomp mcp serve with --identity-key FILE (the Ed25519 key that signed uom.json)",
        )
    answer = await agent.client.submit_deletion_proof(
        identity_key=agent.identity_key,
        memory_hash=args.get("memory_hash") or memory_hash({"key": k, "value": v} for k, v in agent.read.items()),
        fields_accessed=args.get("fields_accessed"),
        method=args.get("method") or agent.deletion_method,
    )
    agent.read.clear()
    return answer


async def _end(agent: Agent, args: dict[str, Any]) -> JSONObject:
    return await agent.client.close_session()


_HANDLERS: dict[str, Callable[[Agent, dict[str, Any]], Awaitable[JSONObject]]] = {
    "memory_read": _read,
    "memory_list": _list,
    "memory_aggregate": _aggregate,
    "grant_describe": _grant,
    "audit_events": _audit,
    "audit_proof": _proof,
    "payload_upload": _upload,
    "deletion_proof_submit": _deletion,
    "session_end": _end,
}
assert set(_HANDLERS) == set(TOOL_NAMES)


# ----------------------------------------------------------------------- the grant in words


def _token_facts(claims: Mapping[str, Any]) -> JSONObject:
    limits = claims.get("limits") if isinstance(claims.get("limits"), dict) else {}
    return {
        "profile": claims.get("profile"),
        "aggregation_only": claims.get("aggregation_only") is True,
        "task_bound": claims.get("task_bound") is True,
        "allowed_fields": claims.get("allowed_fields"),
        "max_read_queries": (limits or {}).get("max_read_queries"),
        "access_token_expires_at": claims.get("expires_at"),
    }


def _names(values: Any) -> str:
    return ", ".join(str(v) for v in values) if isinstance(values, list) and values else ""


def describe(session: Mapping[str, Any], claims: Mapping[str, Any]) -> str:
    """The grant as a few plain sentences (from the session's own view and the token's claims)."""
    read = ((session.get("granted_scopes") or {}).get("read")) or {}
    facts = _token_facts(claims)
    lines = [f"Agent {session.get('agent_id')} may read the user's memory until {session.get('expires_at')}."]
    tags, keys = _names(read.get("tags")), _names(read.get("keys"))
    if tags:
        lines.append(f"Items tagged: {tags}.")
    if keys:
        lines.append(f"Items with the keys: {keys}.")
    if not tags and not keys:
        lines.append("No items.")
    for what, values in (("tagged", read.get("deny_tags")), ("with the keys", read.get("deny_keys"))):
        if _names(values):
            lines.append(f"Never items {what}: {_names(values)}.")
    fields = facts["allowed_fields"] or read.get("allowed_fields")
    if fields:
        lines.append(f"Only these fields of each item: {_names(fields)}.")
    if facts["aggregation_only"]:
        lines.append("Aggregates only (count, sum, avg, min, max): no item is returned.")
    if facts["max_read_queries"] is not None:
        lines.append(f"At most {facts['max_read_queries']} read queries in this session.")
    if facts["task_bound"]:
        lines.append("The session ends with its deletion proof.")
    retention = session.get("data_retention_policy")
    if isinstance(retention, dict) and retention:
        parts = [f"{k}={v}" for k, v in sorted(retention.items()) if isinstance(v, str | int | bool)]
        if parts:
            lines.append("Retention the agent declared: " + ", ".join(parts) + ".")
    lines.append(f"Session {session.get('session_id')} is {session.get('status')}.")
    return " ".join(lines)
