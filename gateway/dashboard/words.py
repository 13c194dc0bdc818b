"""Plain words for the dashboard: scopes, refusal codes, sizes and times."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

# What a refusal code means, said to the owner of the memory (not to the agent).
REFUSALS: dict[str, str] = {
    "INVALID_TOKEN": "The agent's token was not valid (bad signature, wrong audience or malformed).",
    "TOKEN_EXPIRED": "The agent's token had expired; it has to refresh it or be authorized again.",
    "SESSION_REVOKED": "The session had been revoked or closed, so the agent may no longer read.",
    "ACCESS_DENIED": "The agent asked for something outside what you granted.",
    "QUOTA_EXCEEDED": "The agent had used up the number of reads you allowed.",
    "WRITE_NOT_AVAILABLE": "The agent tried to write; writes are not available to agents.",
    "STORE_UNAVAILABLE": "The memory store or the audit log could not be reached, so nothing was given out.",
    "AUDIT_LOG_INCONSISTENT": "The audit log is not the one its last signed checkpoint vouched for (rolled back or "
    "replaced), so nothing was given out.",
    "AUDIT_LOG_DAMAGED": "The audit log failed its own checks (an edited or deleted event), so nothing was given out.",
    "SESSION_NOT_FOUND": "The agent named a session that does not exist.",
    "INVALID_REQUEST": "The agent's request was malformed.",
    "UNAUTHORIZED": "A management call came without your admin credential.",
    "CERT_REQUIRED": "The agent connected without an acceptable client certificate.",
    "AGENT_MISMATCH": "The token, the certificate and the agent name did not all name the same agent.",
    "TOKEN_BINDING_MISMATCH": "The token is bound to another key or certificate than the one presented (a stolen "
    "token?).",
    "DPOP_INVALID": "The proof of key possession (DPoP) was missing or wrong.",
    "REFRESH_REUSED": "A refresh token was used twice; the whole session was revoked to be safe.",
    "NOT_FOUND": "The agent asked for a route that does not exist.",
    "METHOD_NOT_ALLOWED": "The agent used a method this route does not take.",
    "PAYLOAD_TOO_LARGE": "The agent sent more data than allowed.",
    "RATE_LIMITED": "The agent asked too often and was slowed down.",
    "STORE_BUSY": "The store was busy for too long; the agent may retry.",
    "UPSTREAM_ERROR": "The gateway could not get an answer from the guard.",
    "UPSTREAM_TIMEOUT": "The guard did not answer in time.",
    "PAYLOAD_QUOTA_EXCEEDED": "The agent already has too many payloads waiting for you.",
    "UPLOAD_URL_INVALID": "A payload upload link was unknown, spent or expired.",
    "PAYLOAD_INVALID": "A sealed payload did not open (wrong key, tampered or truncated).",
    "INVALID_STATE": "The session was not in a state that allows this.",
}

ACTIONS: dict[str, str] = {
    "read": "read a memory",
    "read_key": "read a memory",
    "read_tag": "read memories by tag",
    "query": "searched memories",
    "aggregate": "asked for a total",
    "audit": "read its audit log",
    "health": "checked the gateway",
    "renew": "renewed its certificate",
    "unknown": "sent a request",
    "payload_upload": "sent you a payload",
    "payload_upload_url": "asked for a payload upload link",
    "payload_presigned": "sent a payload by upload link",
    "payload_refused": "a payload was refused",
    "session_created": "session requested",
    "session_granted": "session granted",
    "session_revoked": "session revoked",
    "session_closed": "session closed",
    "session_expired": "session expired",
    "refresh": "refreshed its token",
    "deletion_proof": "sent a deletion proof",
    "deletion_proof_missing": "ended without the deletion proof it owed",
    "refresh_reuse": "reused a refresh token",
    "payload_uploaded": "sent you a payload",
    "payload_opened": "you opened a payload",
    "payload_removed": "you removed a payload",
    "audit_gap": "refusals that could not be logged one by one",
}


# The guard's user-only ``detail`` of a policy refusal (gateway/core/policy.py), in words.
DETAILS: dict[str, str] = {
    "key in deny_keys": "You explicitly denied this memory to the agent.",
    "tag in deny_tags": "The agent searched a tag you explicitly denied.",
    "field outside allowed_fields": "The agent asked for a field you did not allow.",
    "granted key does not exist": "The agent asked for a memory you granted, but it does not exist.",
    "high sensitivity item needs an explicit key grant": "The memory is highly sensitive: it is given out only "
    "when you grant it by name.",
    "key does not exist": "The agent asked for a memory that does not exist (it was only told it is out of scope).",
    "no granted key or tag matches": "The agent asked for a memory outside what you granted.",
    "tag not in tags": "The agent searched a tag you did not grant.",
    # a certificate of your CA refused after the handshake (the event names the agent and the serial)
    "revoked": "The agent's certificate is revoked; it was told so and let in nowhere.",
    "expired": "The agent's certificate has expired; it needs a new one from you.",
    "not_yet_valid": "The agent's certificate is not valid yet: a clock (the agent's or the gateway's) is wrong.",
    "ca_invalid": "Your agent CA is outside its validity period, so no agent certificate can be trusted.",
    "crl_expired": "The gateway's list of revoked certificates is out of date, so no certificate was accepted.",
}


def refusal(code: str | None, reason: str, detail: str | None = None) -> str:
    """A sentence for a refusal: the policy detail's meaning, else the code's, else the reason."""
    if detail and detail in DETAILS:
        return DETAILS[detail]
    if detail and detail.startswith("item tag ") and detail.endswith(" in deny_tags"):
        return f"The memory carries the tag {detail[9:-13]}, which you denied to the agent."
    if detail and detail.endswith("needs the user's min/max grant"):
        return "The agent asked for a minimum or maximum, which you did not allow."
    if code and code in REFUSALS:
        return REFUSALS[code]
    text = detail or reason
    return text[:1].upper() + text[1:] if text else "Refused."


def action(name: str) -> str:
    return ACTIONS.get(name, name.replace("_", " "))


def _names(values: Any) -> list[str]:
    return [str(v) for v in values] if isinstance(values, list | tuple) else []


def scope(granted: Mapping[str, Any] | None) -> list[str]:
    """One sentence per part of a granted (or requested) scope."""
    if not granted:
        return ["nothing granted yet"]
    out: list[str] = []
    read = granted.get("read") if isinstance(granted.get("read"), Mapping) else None
    if read:
        tags, keys = _names(read.get("tags")), _names(read.get("keys"))
        if tags:
            out.append("may read memories tagged " + ", ".join(tags))
        if keys:
            out.append("may read the memories " + ", ".join(keys))
        if not tags and not keys:
            out.append("may read nothing")
        for name, what in (("deny_tags", "never memories tagged "), ("deny_keys", "never the memories ")):
            if _names(read.get(name)):
                out.append(what + ", ".join(_names(read.get(name))))
        if read.get("allowed_fields") is not None:
            fields = _names(read.get("allowed_fields"))
            out.append("only the fields " + ", ".join(fields) if fields else "no fields of them")
    else:
        out.append("may read nothing")
    write = granted.get("write") if isinstance(granted.get("write"), Mapping) else None
    if write and (_names(write.get("tags")) or _names(write.get("keys"))):
        out.append("may write " + ", ".join(_names(write.get("tags")) + _names(write.get("keys"))))
    return out


def size(n: int) -> str:
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} bytes"


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def ago(ts: float, now: float | None = None) -> str:
    s = int((time.time() if now is None else now) - ts)
    future = s < 0
    s = abs(s)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            text = f"{s // n} {unit}"
            break
    else:
        text = f"{s} s"
    return f"in {text}" if future else f"{text} ago"
