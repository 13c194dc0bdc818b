"""``uomp registry add|list|rm|search|show|install``: agents listed on ERC-8004 Identity Registries (spec §17).

None is configured by default and nothing needs one (§17.3). ``install`` fetches an agent's
registration file and uom.json, checks them (gateway/registry/ops.py) and writes them where
``uomp authorize DIR`` reads them; the decision stays the user's, in ``authorize``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gateway.cli.main import paths_from
from gateway.config import RegistryConfig, load_section
from gateway.core import manifest
from gateway.registry import ops
from gateway.registry.fetch import shown


def _cfg(args: argparse.Namespace) -> RegistryConfig:
    paths = paths_from(args)
    overrides: dict[str, object] = {}
    if getattr(args, "ca_file", None):
        overrides["ca_file"] = args.ca_file
    if getattr(args, "allow_internal", False):
        overrides["allow_internal"] = True
    return load_section(RegistryConfig, "registry", file=paths.config_file, overrides=overrides)


def _add(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    entry = ops.add_registry(
        paths,
        _cfg(args),
        args.registry,
        args.rpc,
        from_block=args.from_block,
        reputation=args.reputation or "",
        feedback_key_file=args.feedback_key or "",
    )
    print(f"registry {entry.id} added (node {ops.redact(entry.rpc_url)}, chain {entry.chain_id})")
    return 0


def _list(args: argparse.Namespace) -> int:
    entries = ops.load_registries(paths_from(args))
    if args.json:
        out = [{"id": e.id, "node": ops.redact(e.rpc_url), "added_at": e.added_at} for e in entries]
        print(json.dumps({"registries": out}, indent=2))
        return 0
    if not entries:
        print("no registry configured (none is needed; add one with uomp registry add CHAIN_ID:0xADDRESS --rpc URL)")
    for e in entries:
        print(f"{e.id}  node {ops.redact(e.rpc_url)}  added {e.added_at}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    gone = ops.remove_registry(paths_from(args), args.registry)
    print(f"registry {gone.id} removed (its search index too)")
    return 0


def _search(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    report = ops.search(paths, _cfg(args), args.keyword, registry=args.registry, refresh=args.refresh)
    if args.json:
        print(
            json.dumps(
                {
                    "results": [r.__dict__ for r in report.results],
                    "indexed": report.indexed,
                    "pending": report.pending,
                    "failed": report.failed,
                },
                indent=2,
                ensure_ascii=False,
            )
        )
        return 0
    for r in report.results:
        print(f"{r.registry}:{r.agent_id}  {r.name}  (owner {r.owner})")
        if r.description:
            print(f"    {r.description.splitlines()[0][:160]}")
        if r.services:
            print(f"    services: {', '.join(r.services)}")
    tail = f"{len(report.results)} match(es) among {report.indexed} indexed agent(s)"
    if report.pending:
        tail += f"; {report.pending} not fetched yet (run the search again)"
    if report.failed:
        tail += f"; {report.failed} with an unreadable registration file"
    print(tail)
    return 0


def _show(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    reg_spec, agent_id = ops.parse_agent(args.agent)
    got = ops.lookup(paths, _cfg(args), args.registry or reg_spec, agent_id, with_manifest=False)
    r = got.registration
    print(f"Agent {agent_id} of registry {got.registry.id}, owner {got.owner}")
    print(f"  name: {r.name}")
    if r.description:
        print(f"  description: {r.description.splitlines()[0][:400]}")
    for s in r.services:
        print(f"  service {s.name}: {shown(s.endpoint) if '://' in s.endpoint else s.endpoint}")
    if r.supported_trust:
        print(f"  supported trust: {', '.join(r.supported_trust)}")
    print(f"  registration file: {_pin_text(got.registration_pinned)}")
    return 0


def _pin_text(pinned: str) -> str:
    return {
        "chain-metadata": "matches the hash the registry records",
        "data-uri": "stored on chain",
        "none": "not pinned by the registry (no registrationHash metadata)",
    }[pinned]


def _install(args: argparse.Namespace) -> int:
    paths = paths_from(args)
    reg_spec, agent_id = ops.parse_agent(args.agent)
    out = Path(args.out)
    got, m = ops.install(paths, _cfg(args), args.registry or reg_spec, agent_id, out, force=args.force)
    ident = manifest.verify_identity(m.raw)
    print(f"Installed {m.agent.name} ({m.agent.id}) version {m.agent.version} into {out}")
    print(f"  listed in registry {got.registry.id} as agent {agent_id}, owner {got.owner}")
    print(f"  registration file: {_pin_text(got.registration_pinned)}")
    print(
        "  uom.json: "
        + ("matches the manifestHash of the registration file" if got.manifest_pinned else "NOT pinned by a hash")
    )
    print("  publisher: " + (f"signature verified ({ident.did})" if ident.verified else f"unverified: {ident.reason}"))
    print(f"Nothing is granted yet: review and decide with  uomp authorize {out}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from gateway.cli.guard import guard_config, open_auth
    from gateway.registry import reputation

    paths = paths_from(args)
    auth = open_auth(paths, guard_config(args, paths))
    try:
        sessions = auth.list_sessions(limit=1000)
    finally:
        auth.close_db()
        auth.audit.close()
    todo, skipped = reputation.pending(paths, sessions)
    for why in skipped:
        print(f"not reported: {why}")
    if not todo:
        print("no abnormal session to report")
        return 0
    cfg = _cfg(args)
    for session_id, entry, agent_id in todo:
        if not args.yes:
            print(f"would report session {session_id}: agent {agent_id} of {entry.id} (pass --yes to send)")
            continue
        done = reputation.send(paths, cfg, session_id, entry, agent_id)
        print(f"reported session {session_id}: feedback for agent {agent_id} of {entry.id}, transaction {done.tx}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp registry`` to the command line."""
    p = sub.add_parser("registry", help="find agents on ERC-8004 registries and install their manifests (spec §17)")
    rsub = p.add_subparsers(dest="registry_command", metavar="ACTION", required=True)

    def fetch_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--ca-file", help="extra CA certificates (PEM) for https fetches ([registry] ca_file)")
        q.add_argument(
            "--allow-internal",
            action="store_true",
            help="let fetches reach loopback/private addresses and http on loopback (a registry you run yourself)",
        )

    a = rsub.add_parser("add", help="add a registry: CHAIN_ID:0xADDRESS and its chain's JSON-RPC URL")
    a.add_argument("registry", help="CHAIN_ID:0xADDRESS (or eip155:CHAIN_ID:0xADDRESS)")
    a.add_argument("--rpc", required=True, help="the chain's JSON-RPC URL (kept in registries.json, 0600)")
    a.add_argument("--from-block", type=int, default=0, help="index events from this block on (the deployment block)")
    a.add_argument(
        "--reputation", help="opt in to reporting abnormal sessions: the registry's Reputation Registry (0x address)"
    )
    a.add_argument("--feedback-key", help="with --reputation: the 0600 key file of the account that reports")
    a.set_defaults(func=_add)
    ls = rsub.add_parser("list", help="the registries you added")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)
    r = rsub.add_parser("rm", help="remove a registry")
    r.add_argument("registry")
    r.set_defaults(func=_rm)
    s = rsub.add_parser("search", help="agents whose name, description, services or trust match KEYWORD")
    s.add_argument("keyword")
    s.add_argument("--registry", help="only this registry (CHAIN_ID:0xADDRESS)")
    s.add_argument("--refresh", action="store_true", help="fetch again the registration files that failed")
    s.add_argument("--json", action="store_true")
    fetch_flags(s)
    s.set_defaults(func=_search)
    sh = rsub.add_parser("show", help="one agent's registration, read from the chain now")
    sh.add_argument("agent", help="N (with one registry or --registry) or CHAIN_ID:0xADDRESS:N")
    sh.add_argument("--registry")
    fetch_flags(sh)
    sh.set_defaults(func=_show)
    rp = rsub.add_parser(
        "report", help="report abnormal sessions (no deletion proof) to the registries you opted in for (§19.5)"
    )
    rp.add_argument("--yes", action="store_true", help="send the feedback (without it: only say what would be sent)")
    rp.set_defaults(func=_report)
    i = rsub.add_parser("install", help="fetch and check an agent's uom.json into DIR, for uomp authorize DIR")
    i.add_argument("agent", help="N (with one registry or --registry) or CHAIN_ID:0xADDRESS:N")
    i.add_argument("--registry")
    i.add_argument("--out", required=True, help="the directory to write uom.json and registry.json into")
    i.add_argument("--force", action="store_true", help="replace a different uom.json already in DIR")
    fetch_flags(i)
    i.set_defaults(func=_install)
