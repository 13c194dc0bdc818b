"""Every limit a manifest asks for reaches the grant, through the real CLI, the
Auth Service and the guard.

The user may narrow further; anything wider than the agent asked for needs ``--widen`` (CLI) or
``"widen": true`` (management API).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from guardkit import call, running_guard, seed, unix_session

from gateway import ca_store, keys
from gateway.cli.guard import open_auth
from gateway.cli.main import main
from gateway.config import GuardConfig, Paths
from gateway.core import jose, restrictions, tokens
from gateway.core.capability import Capability, Scope
from gateway.errors import UompError

BASE: dict[str, Any] = {
    "uomp_version": "1.0",
    "agent": {"id": "cal", "name": "Calendar", "version": "1.0.0"},
    "requested_scopes": {"read": {"tags": ["preference", "identity"], "keys": []}},
    "data_retention_policy": {"max_retention_seconds": 0, "deletion_method": "process_termination"},
}


def cli(home: Paths, *args: str) -> int:
    return main(["--home", str(home.home), *args])


def manifest_with(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = json.loads(json.dumps(BASE))
    change(doc)
    return doc


def authorize(home: Paths, tmp_path: Path, doc: dict[str, Any], *extra: str) -> tuple[int, Capability | None]:
    agent = tmp_path / "agent"
    agent.mkdir(exist_ok=True)
    (agent / "uom.json").write_text(json.dumps(doc))
    env = tmp_path / "agent.env"
    env.unlink(missing_ok=True)
    rc = cli(home, "authorize", str(agent), "--yes", "--env-file", str(env), *extra)
    if rc != 0:
        assert not env.exists()
        return rc, None
    token = dict(line.split("=", 1) for line in env.read_text().splitlines())["UOM_TOKEN"]
    return rc, tokens.verify_token(token, keys.load_public_keys(home), now=time.time())


def _read(doc: dict[str, Any]) -> dict[str, Any]:
    read: dict[str, Any] = doc["requested_scopes"]["read"]
    return read


# --------------------------------------------------------- manifest restriction field -> token


def _check_fields(cap: Capability) -> None:
    assert cap.allowed_fields == ("key", "value")
    assert cap.claims["allowed_fields"] == ["key", "value"]
    assert cap.claims["scopes"]["read"]["allowed_fields"] == ["key", "value"]


def _check_deny_tags(cap: Capability) -> None:
    assert cap.read.deny_tags == ("private",)


def _check_deny_keys(cap: Capability) -> None:
    assert cap.read.deny_keys == ("user.password",)


def _check_tags_keys(cap: Capability) -> None:
    assert (cap.read.tags, cap.read.keys) == (("preference",), ("user.display_name",))


def _check_aggregate_only(cap: Capability) -> None:
    assert cap.aggregation_only is True


def _check_items_allowed(cap: Capability) -> None:
    assert cap.aggregation_only is False


def _check_no_write(cap: Capability) -> None:
    assert cap.write.is_empty() and cap.claims["limits"]["max_write_queries"] == 0


RESTRICTIONS: list[Any] = [
    pytest.param(
        lambda d: _read(d).update(allowed_fields=["key", "value"]),
        _check_fields,
        "allowed_fields=['key', 'value']",
        id="read.allowed_fields",
    ),
    pytest.param(
        lambda d: _read(d).update(deny_tags=["private"]), _check_deny_tags, "deny_tags=['private']", id="read.deny_tags"
    ),
    pytest.param(
        lambda d: _read(d).update(deny_keys=["user.password"]),
        _check_deny_keys,
        "deny_keys=['user.password']",
        id="read.deny_keys",
    ),
    pytest.param(
        lambda d: _read(d).update(tags=["preference"], keys=["user.display_name"]),
        _check_tags_keys,
        "keys=['user.display_name']",
        id="read.tags+keys",
    ),
    pytest.param(
        lambda d: d.update(required_capabilities=["memory.aggregate"]),
        _check_aggregate_only,
        "aggregates only",
        id="capabilities-aggregate-only",
    ),
    pytest.param(
        lambda d: d.update(optional_capabilities=["memory.aggregate"]),
        _check_aggregate_only,
        "aggregates only",
        id="optional-capabilities-aggregate-only",
    ),
    pytest.param(
        lambda d: d.update(required_capabilities=["memory.read"], optional_capabilities=["memory.aggregate"]),
        _check_items_allowed,
        "memory.read",
        id="capabilities-read-and-aggregate",
    ),
    pytest.param(
        lambda d: d["requested_scopes"].update(write={"tags": ["preference"], "keys": []}),
        _check_no_write,
        "writes are not available",
        id="write-scope-never-granted",
    ),
]


@pytest.mark.parametrize(("change", "check", "shown"), RESTRICTIONS)
def test_each_manifest_restriction_reaches_the_token(
    home: Paths,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: Callable[[dict[str, Any]], None],
    check: Callable[[Capability], None],
    shown: str,
) -> None:
    rc, cap = authorize(home, tmp_path, manifest_with(change))
    assert rc == 0 and cap is not None
    check(cap)
    assert shown in capsys.readouterr().out  # and the panel shows it before the yes


def test_capabilities_are_shown(home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = manifest_with(
        lambda d: d.update(
            required_capabilities=["memory.read", "memory.write", "memory.teleport"],
            optional_capabilities=["memory.query"],
        )
    )
    assert authorize(home, tmp_path, doc)[0] == 0
    out = capsys.readouterr().out
    assert "required memory.read (read single items by key)" in out
    assert "memory.write (write items (NOT available in this version))" in out
    assert "memory.teleport (unknown to this gateway)" in out
    assert "optional memory.query (read items by tag)" in out


def test_proof_required_is_kept_on_the_session(home: Paths, tmp_path: Path) -> None:
    doc = manifest_with(lambda d: d["data_retention_policy"].update(proof_required=True))
    rc, cap = authorize(home, tmp_path, doc)
    assert rc == 0 and cap is not None
    auth = open_auth(home, GuardConfig())
    try:
        assert (auth.session(cap.session_id).retention or {}).get("proof_required") is True
    finally:
        auth.close_db()
        auth.audit.close()


# --------------------------------------------------------------- the user narrows / widens


FIELDS = lambda d: _read(d).update(allowed_fields=["key", "value", "tags"])  # noqa: E731


@pytest.mark.parametrize(
    ("change", "args", "fields"),
    [
        (FIELDS, ["--allowed-field", "key"], ("key",)),
        (FIELDS, ["--allowed-field", "key", "--allowed-field", "source"], None),
        (FIELDS, ["--allowed-field", "key", "--allowed-field", "source", "--widen"], ("key", "source")),
        (lambda d: None, ["--allowed-field", "key"], ("key",)),
        (lambda d: _read(d).update(deny_tags=["private"]), ["--deny-tag", "identity"], "deny"),
        (lambda d: None, ["--tag", "preference"], "narrow-tags"),
        (lambda d: None, ["--tag", "financial"], None),
        (lambda d: None, ["--tag", "financial", "--widen"], "wide-tags"),
        (lambda d: d.update(required_capabilities=["memory.aggregate"]), ["--aggregation-only"], "agg"),
    ],
    ids=[
        "narrow-fields",
        "extra-field-refused",
        "extra-field-widen",
        "fields-where-none-asked",
        "add-deny-tag",
        "narrow-tags",
        "extra-tag-refused",
        "extra-tag-widen",
        "aggregation-only-twice",
    ],
)
def test_user_narrows_freely_and_widens_only_with_widen(
    home: Paths,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: Callable[[dict[str, Any]], None],
    args: list[str],
    fields: Any,
) -> None:
    rc, cap = authorize(home, tmp_path, manifest_with(change), *args)
    if fields is None:
        assert rc == 1 and cap is None
        err = capsys.readouterr().err
        assert "INVALID_REQUEST" in err and "--widen" in err
        return
    assert rc == 0 and cap is not None
    if fields == "deny":
        assert set(cap.read.deny_tags) == {"private", "identity"}
    elif fields == "narrow-tags":
        assert cap.read.tags == ("preference",)
    elif fields == "wide-tags":
        assert cap.read.tags == ("financial",)
        assert "WIDER THAN REQUESTED" in capsys.readouterr().out
    elif fields == "agg":
        assert cap.aggregation_only
    else:
        assert cap.allowed_fields == fields and cap.read.allowed_fields == fields


# ------------------------------------------------------------------- requires_remote


def test_requires_remote_is_refused_locally_unless_overridden(
    home: Paths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = manifest_with(lambda d: d.update(requires_remote=True))
    assert authorize(home, tmp_path, doc)[0] == 1
    captured = capsys.readouterr()
    assert "requires_remote: true" in captured.out
    assert "INVALID_REQUEST" in captured.err and "--remote" in captured.err and "--allow-local" in captured.err
    rc, cap = authorize(home, tmp_path, doc, "--allow-local")
    assert rc == 0 and cap is not None and cap.profile == "local"
    assert "runs on this machine although it declares requires_remote" in capsys.readouterr().out
    ca_store.init_all(home)
    agent = tmp_path / "agent"
    assert (
        cli(
            home,
            "authorize",
            str(agent),
            "--yes",
            "--remote",
            "--out",
            str(tmp_path / "files"),
            "--bundle",
            str(tmp_path / "bundle.json"),
        )
        == 0
    )


# ------------------------------------------------------------- the Auth Service enforces too

REQUESTED = {"tags": ["preference"], "keys": [], "deny_tags": ["private"], "allowed_fields": ["key", "value"]}


@pytest.mark.parametrize(
    ("read", "extra", "why"),
    [
        ({**REQUESTED}, {}, None),
        ({**REQUESTED, "allowed_fields": ["key"]}, {}, None),
        ({**REQUESTED, "deny_tags": ["private", "identity"]}, {}, None),
        ({**REQUESTED, "allowed_fields": None}, {"allowed_fields": ["key", "source"]}, "fields not requested: source"),
        ({**REQUESTED}, {"allowed_fields": ["key", "source"]}, None),  # intersection: key
        ({**REQUESTED, "deny_tags": []}, {}, "denied tags the agent asked to be kept from: private"),
        ({**REQUESTED, "allowed_fields": None}, {}, "whole items although the agent asked only for fields"),
        ({**REQUESTED, "allowed_fields": ["key", "value", "source"]}, {}, "fields not requested: source"),
        ({**REQUESTED, "tags": ["preference", "financial"]}, {}, "tags not requested: financial"),
    ],
    ids=[
        "as-requested",
        "fewer-fields",
        "more-denies",
        "top-level-extra-field",
        "top-level-intersects",
        "deny-dropped",
        "fields-dropped",
        "scope-extra-field",
        "extra-tag",
    ],
)
def test_auth_service_grant_keeps_requested_limits(
    home: Paths, read: dict[str, Any], extra: dict[str, Any], why: str | None
) -> None:
    auth = open_auth(home, GuardConfig())
    try:

        def grant(widen: bool) -> dict[str, Any]:
            sid = auth.create_session({"agent_id": "cal", "requested_scopes": {"read": REQUESTED}})["session_id"]
            body = {"granted_scopes": {"read": {k: v for k, v in read.items() if v is not None}}, **extra}
            return auth.grant(sid, {**body, "widen": widen})

        if why is not None:
            with pytest.raises(UompError) as info:
                grant(False)
            assert info.value.code == "INVALID_REQUEST" and why in info.value.message
            answer = grant(True)  # the user may widen, explicitly
        else:
            answer = grant(False)
        claims = jose.parse_compact(answer["token"]).payload
        fields = claims.get("allowed_fields")
        assert fields == claims["scopes"]["read"].get("allowed_fields")  # scope and claim agree
        if why is None:
            assert fields is not None and set(fields) <= {"key", "value"}
            assert "private" in claims["scopes"]["read"]["deny_tags"]
    finally:
        auth.close_db()
        auth.audit.close()


def test_plan_keeps_every_limit() -> None:
    requested = Scope(tags=("a", "b"), keys=("k",), deny_tags=("x",), deny_keys=("y",), allowed_fields=("key",))
    plan = restrictions.plan_read_grant(requested, capabilities=["memory.aggregate"])
    assert plan.scope == requested and plan.allowed_fields == ("key",) and plan.aggregation_only
    assert plan.widened == ()
    plan = restrictions.plan_read_grant(requested, tags=["c"], allowed_fields=["key", "value"])
    assert plan.widened == ("tags not requested: c", "fields not requested: value")


# ------------------------------------------------------------------------ through the guard


async def test_the_guard_returns_only_the_requested_fields(home: Paths, tmp_path: Path) -> None:
    seed(home)
    doc = manifest_with(lambda d: _read(d).update(allowed_fields=["key", "value"], deny_tags=["private"]))
    rc, cap = authorize(home, tmp_path, doc)
    assert rc == 0 and cap is not None
    token = dict(line.split("=", 1) for line in (tmp_path / "agent.env").read_text().splitlines())["UOM_TOKEN"]
    async with running_guard(home), unix_session(home) as s:
        status, body, _ = await call(s, "GET", "/v1/memory/preference.theme", token=token)
        assert status == 200 and body == {"key": "preference.theme", "value": "dark"}
        status, body, _ = await call(s, "GET", "/v1/memory/preference.secret_hobby", token=token)
        assert status == 403 and body["error"]["code"] == "ACCESS_DENIED"
