"""The data directory and the signing keys.

* Every directory ``uomp`` creates is 0700 whatever the umask (parents of UOMP_HOME included).
* A data directory, ``.secrets`` or ``ca/`` owned by another user or writable by group/others is
  refused by every command (``UNSAFE_PERMISSIONS``), like ssh's StrictModes: someone else could have
  planted ``jwks.json`` there. Tests run as root, so "another user" is made with ``os.chown``.
* ``uomp agent issue --out DIR`` never changes an existing directory's mode; its files are 0600.
* ``uomp keys rotate --revoke-old``: tokens signed by the old key die at once, in the running guard
  and gateway (no restart, no SIGHUP); a revoked key stays distrusted even if it reappears.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from gatewaykit import agent_call, agent_session, appliance
from guardkit import admin_headers, call, grant, guard_config, running_guard, seed, unix_session

from gateway import ca_store, keys
from gateway.cli.main import main
from gateway.config import Paths
from gateway.core import jose
from gateway.errors import UompError

UOMP = [sys.executable, "-m", "gateway.cli.main"]
OTHER_UID = 4242


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def uomp(home: Path, *args: str, umask: int | None = None) -> subprocess.CompletedProcess[str]:
    def pre() -> None:
        if umask is not None:
            os.umask(umask)

    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, preexec_fn=pre
    )


# -------------------------------------------------------------------------------- creation modes


def test_init_under_umask_000_makes_every_directory_private(tmp_path: Path) -> None:
    home = tmp_path / "a" / "b" / "home"
    res = uomp(home, "init", umask=0)
    assert res.returncode == 0, res.stderr
    for d in (tmp_path / "a", tmp_path / "a" / "b", home, home / ".secrets", home / "ca"):
        assert mode(d) == 0o700, d
    for f in home.rglob("*"):
        if f.is_file() and f.suffix not in (".crt", ".pem") and f.name not in ("jwks.json", "ed25519-public.jwk"):
            assert not mode(f) & 0o077, f  # nothing secret is readable by others, even under umask 000
    # a second run and an issue under umask 000 keep it so
    out = tmp_path / "x" / "agent"
    res = uomp(home, "agent", "issue", "bot", "--out", str(out), umask=0)
    assert res.returncode == 0, res.stderr
    assert mode(tmp_path / "x") == 0o700 and mode(out) == 0o700
    assert {f.name: mode(f) for f in out.iterdir()} == {"agent.key": 0o600, "agent.crt": 0o600, "ca.crt": 0o600}


def test_issue_out_keeps_an_existing_directory_mode(home: Paths, tmp_path: Path) -> None:
    ca_store.init_all(home)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    assert main(["--home", str(home.home), "agent", "issue", "bot", "--out", str(shared)]) == 0
    assert mode(shared) == 0o755  # not silently changed
    assert mode(shared / "agent.key") == 0o600 and mode(shared / "agent.crt") == 0o600


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param(lambda d: os.chmod(d, 0o777), id="world-writable"),
        pytest.param(lambda d: os.chmod(d, 0o770), id="group-writable"),
        pytest.param(lambda d: os.chown(d, OTHER_UID, -1), id="owned-by-another-user"),
    ],
)
def test_issue_out_refuses_a_directory_others_can_write(
    home: Paths, tmp_path: Path, setup: Callable[[Path], None], capsys: pytest.CaptureFixture[str]
) -> None:
    ca_store.init_all(home)
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    setup(out)
    before = os.stat(out)
    assert main(["--home", str(home.home), "agent", "issue", "bot", "--out", str(out)]) == 1
    assert "UNSAFE_PERMISSIONS" in capsys.readouterr().err
    assert not any(out.iterdir())
    after = os.stat(out)
    assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid)


# ------------------------------------------------------------------------------ strict modes


def _other_users_home(tmp_path: Path) -> Path:
    """A data directory another user made for us, with their own signing key planted in it."""
    planted = tmp_path / "planted"
    assert uomp(planted, "init").returncode == 0
    for p in [planted, *planted.rglob("*")]:
        os.chown(p, OTHER_UID, OTHER_UID, follow_symlinks=False)
    return planted


BREAKS = [
    pytest.param(lambda h: os.chmod(h, 0o777), "data directory", id="home-world-writable"),
    pytest.param(lambda h: os.chmod(h, 0o770), "data directory", id="home-group-writable"),
    pytest.param(lambda h: os.chown(h, OTHER_UID, -1), "data directory", id="home-other-owner"),
    pytest.param(lambda h: os.chmod(h / ".secrets", 0o733), "secrets directory", id="secrets-writable"),
    pytest.param(lambda h: os.chown(h / ".secrets", OTHER_UID, -1), "secrets directory", id="secrets-other-owner"),
    pytest.param(lambda h: os.chmod(h / "ca", 0o775), "CA directory", id="ca-group-writable"),
    pytest.param(lambda h: os.chown(h / "ca", OTHER_UID, -1), "CA directory", id="ca-other-owner"),
    pytest.param(lambda h: os.chmod(h.parent, 0o777), "a parent of", id="parent-writable-no-sticky"),
    pytest.param(lambda h: os.chown(h.parent, OTHER_UID, -1), "a parent of", id="parent-other-owner"),
]

COMMANDS = [
    ["init"],
    ["sessions", "list"],
    ["agent", "list"],
    ["keys", "rotate"],
    ["audit"],
    ["agent", "issue", "bot", "--out", "OUT"],
    ["ca", "init"],
    ["memory", "list"],
]


@pytest.mark.parametrize(("brk", "what"), BREAKS)
def test_every_command_refuses_an_unsafe_home(
    tmp_path: Path, brk: Callable[[Path], None], what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "p" / "home"
    assert main(["--home", str(home), "init"]) == 0
    brk(home)
    capsys.readouterr()
    for cmd in COMMANDS:
        rc = main(["--home", str(home), *[str(tmp_path / "out") if a == "OUT" else a for a in cmd]])
        err = capsys.readouterr().err
        assert rc == 1, (cmd, err)
        assert "UNSAFE_PERMISSIONS" in err and what in err, (cmd, err)
        assert "chmod" in err or "chown" in err, err  # and says how to fix it


def test_gateway_start_refuses_an_unsafe_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert uomp(home, "init").returncode == 0
    os.chmod(home / ".secrets", 0o777)
    res = uomp(home, "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port")
    assert res.returncode == 1 and "UNSAFE_PERMISSIONS" in res.stderr, res.stderr


def test_safe_home_and_sticky_parent_are_fine(tmp_path: Path) -> None:
    parent = tmp_path / "tmpdir"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # like /tmp: others can create entries, not rename ours
    home = parent / "home"
    assert uomp(home, "init").returncode == 0
    assert uomp(home, "sessions", "list").returncode == 0


async def test_planted_jwks_in_another_users_directory_is_not_trusted(tmp_path: Path) -> None:
    planted = _other_users_home(tmp_path)
    paths = Paths(planted)
    for load in (keys.load_public_keys, keys.load_signing_key, keys.load_admin, ca_store.load_ca_cert):
        with pytest.raises(UompError) as exc:
            load(paths)  # type: ignore[operator]
        assert exc.value.code == "UNSAFE_PERMISSIONS", load
    # the guard refuses to start on it, in process and as the CLI starts it
    with pytest.raises(UompError) as exc2:
        async with running_guard(paths, serve_tcp=False):
            pass
    assert exc2.value.code == "UNSAFE_PERMISSIONS"
    res = uomp(planted, "guard", "serve", "--no-tcp")
    assert res.returncode == 1 and "UNSAFE_PERMISSIONS" in res.stderr and f"owned by uid {OTHER_UID}" in res.stderr


# ---------------------------------------------------------------------------- key revocation


def test_revoked_key_is_distinct_from_retired(home: Paths) -> None:
    first = keys.load_signing_key(home).kid
    keys.rotate(home, max_token_lifetime=3600)
    second = keys.load_signing_key(home).kid
    assert set(keys.load_public_keys(home)) == {first, second}  # retired: still trusted
    jwks_with_retired = json.loads(home.jwks.read_text())
    third = keys.rotate(home, max_token_lifetime=3600, revoke_old=True)
    assert set(keys.load_public_keys(home)) == {third}
    assert keys.revoked_kids(home) == {first, second}
    # a revoked key that reappears in jwks.json (restored backup, planted file) is still refused
    doc = json.loads(home.jwks.read_text())
    doc["keys"].extend(jwks_with_retired["keys"])
    home.jwks.write_text(json.dumps(doc))
    assert set(keys.load_public_keys(home)) == {third}
    # a private key file put back from a backup does not sign again either
    assert keys.load_signing_key(home).kid == third


async def _poll(check: Callable[[], object], what: str) -> None:
    """Until ``await check()`` is true; generous deadline (the watchers look every 1-2 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if await check():  # type: ignore[misc]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within 60 s: {what}")


async def test_rotate_revoke_old_kills_tokens_in_the_running_guard(home: Paths) -> None:
    seed(home)
    async with running_guard(home, guard_config()) as g, unix_session(home) as s, aiohttp.ClientSession() as tcp:
        base = f"http://127.0.0.1:{g.tcp_port}"
        old = await grant(s, home, read={"tags": ["preference"], "keys": []}, audience=base)
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=old["token"], base=base)
        assert status == 200, body
        # the session stays active (--keep-sessions): what refuses the token is the revoked key alone
        assert main(["--home", str(home.home), "keys", "rotate", "--revoke-old", "--keep-sessions"]) == 0

        async def old_token_refused() -> bool:
            st, answer, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=old["token"], base=base)
            return st == 401 and answer["error"]["code"] == "INVALID_TOKEN"

        await _poll(old_token_refused, "the guard refuses the old key's token")  # no SIGHUP, no restart
        new = await grant(s, home, read={"tags": ["preference"], "keys": []}, audience=base)
        assert json.loads(jose.b64u_decode(new["token"].split(".")[0]))["kid"] == keys.load_signing_key(home).kid
        status, body, _ = await call(tcp, "GET", "/v1/memory/preference.theme", token=new["token"], base=base)
        assert status == 200, body


async def test_rotate_revoke_old_kills_tokens_in_the_running_gateway(
    home: Paths, capsys: pytest.CaptureFixture[str]
) -> None:
    async with appliance(home) as app:
        a = app.agent("agent_a")
        kept = await app.grant(a)
        ended = await app.grant(a)
        async with agent_session(a, home) as s:
            for g in (kept, ended):
                st, item, _ = await agent_call(
                    s, app.base, "/v1/memory/preference.theme", token=g["token"], agent_id="agent_a"
                )
                assert st == 200, item
        # by default the sessions holding old tokens are revoked, and the output names them
        assert main(["--home", str(home.home), "keys", "rotate", "--revoke-old"]) == 0
        out = capsys.readouterr().out
        assert "REVOKED" in out and kept["session_id"] in out and ended["session_id"] in out
        _, info, _ = await call(app.admin, "GET", f"/v1/sessions/{ended['session_id']}", headers=admin_headers(home))
        assert info["status"] == "revoked"

        old_kids = {json.loads(jose.b64u_decode(g["token"].split(".")[0]))["kid"] for g in (kept, ended)}
        fresh: list[str] = []

        async def gateway_reloaded() -> bool:  # the guard and the gateway reload by themselves (no SIGHUP)
            g2 = await app.grant(a)
            if json.loads(jose.b64u_decode(g2["token"].split(".")[0]))["kid"] in old_kids:
                return False  # the guard has not picked up the new signing key yet
            async with agent_session(a, home) as s:
                st, _, _ = await agent_call(
                    s, app.base, "/v1/memory/preference.theme", token=g2["token"], agent_id="agent_a"
                )
            fresh.append(g2["token"])
            return st == 200

        await _poll(gateway_reloaded, "the gateway takes the new key")
        assert app.gateway.state is not None and not old_kids & set(app.gateway.state.public_keys)
        async with agent_session(a, home) as s:
            st, err, _ = await agent_call(
                s, app.base, "/v1/memory/preference.theme", token=kept["token"], agent_id="agent_a"
            )
        assert st == 401 and err["error"]["code"] == "INVALID_TOKEN", err
