"""Agents' enrollment requests on the dashboard's agents page (docs/enrollment.md): what each asked
for, in the words of the consent panel (scopes, retention, publisher verification), and the command
that approves it. Approving stays on the command line, where the consent flags are
(``uomp requests approve``); the page shows the request, it decides nothing."""

from __future__ import annotations

import time
from typing import Any

from gateway import enrollment, trust
from gateway.config import Paths
from gateway.core import didkey, manifest
from gateway.dashboard import words
from gateway.errors import UompError


def publisher_view(m: manifest.Manifest, paths: Paths) -> tuple[str, str]:
    """(state, words) for the manifest's publisher: trusted / untrusted key / unverified / unchecked.

    The checks of ``uomp requests approve`` that need no network (did:key, X.509 to a CA in the trust
    list, OpenPGP to a key in it). A did:web publisher is "unchecked" here: rendering a page never
    fetches anything; its DID document is fetched, under the [registry] fetch rules, when the user approves.
    """
    from gateway.identity.verify import method_of, verify_publisher
    from gateway.registry.fetch import FetchPolicy

    claim = m.agent.publisher or "(none named)"
    if method_of(m.raw) == "did:web":
        did = m.raw["identity"]["did"]
        return "unchecked", (
            f'"{claim}" claims {did}: its DID document is fetched and checked when you approve, not on this page'
        )
    trusted = trust.load(paths)
    ident = verify_publisher(m.raw, trusted, FetchPolicy())
    entry = (ident.trust_entry or trusted.find_did(ident.did)) if ident.verified else None
    if entry is not None:
        return "trusted", f"{entry.name} (verified, {ident.method}: in your trust list)"
    if ident.verified and ident.public_key is not None and ident.method == "did:key":
        return "untrusted", (
            f'"{claim}" signed by a key you have never trusted ({didkey.fingerprint(ident.public_key)})'
        )
    if ident.verified:
        return "untrusted", f'"{claim}" verified by {ident.method} but not in your trust list'
    return "unverified", f'"{claim}" (not verified: {ident.reason})'


def _retention(m: manifest.Manifest) -> str:
    r = m.retention
    if r is None:
        return "no data retention policy: no promise about deleting your data"
    text = f"keeps data up to {r.max_retention_seconds:g} s after the task, deletion by {r.deletion_method}"
    if r.proof_required:
        text += ", deletion proof required"
    if r.third_party_sharing:
        text += "; SHARES your data with third parties"
    return text


def requests(paths: Paths) -> list[dict[str, Any]]:
    """The newest enrollment requests; for a pending one, what it asks for."""
    try:
        rows = enrollment.list_requests(paths)[:50]
    except UompError:
        return []
    now = time.time()
    out = []
    for r in rows:
        view: dict[str, Any] = {
            "request_id": r["request_id"],
            "agent_id": r["agent_id"],
            "status": r["status"],
            "client": r["client"] or "-",
            "key_fingerprint": r["key_fingerprint"],
            "asked": words.ago(r["created_at"], now),
            "reason": r["reason"],
        }
        if r["status"] == enrollment.PENDING:
            try:
                m = manifest.parse_manifest(enrollment.pending(paths, r["request_id"]).manifest)
            except UompError as exc:
                view["problem"] = exc.message
            else:
                view["scopes"] = f"tags {list(m.read.tags)}, keys {list(m.read.keys)}"
                view["retention"] = _retention(m)
                view["publisher_state"], view["publisher"] = publisher_view(m, paths)
                view["name"] = m.agent.name
        out.append(view)
    return out
