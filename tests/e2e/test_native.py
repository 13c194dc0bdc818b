"""The request path compiled with mypyc (gateway/native.py): the suite runs it, a build serves only
the sources it was made from (any edit: plain Python), an incomplete build is never used, and
``uomp gateway start`` answers the same compiled and as plain Python."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from startkit import read_until, remote_calendar

from gateway import native

SUFFIX = str(sysconfig.get_config_var("EXT_SUFFIX"))
UOMP = [sys.executable, "-m", "gateway.cli.main"]
PROBE = (
    "import json, gateway, gateway.httpd, gateway.remote.app as app;"
    "print(json.dumps([gateway.native.status, gateway.httpd.__file__, app.__file__]))"
)


def probe(env: dict[str, str] | None = None, pythonpath: Path | None = None) -> tuple[str, str, str]:
    """(status, gateway.httpd's file, gateway.remote.app's file) in a fresh interpreter."""
    full = {**os.environ, **(env or {})}
    if pythonpath is not None:
        full["PYTHONPATH"] = str(pythonpath)
    cwd = pythonpath or Path("/")  # (-c puts the working directory first on the path)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, env=full, cwd=cwd)
    assert out.returncode == 0, out.stderr
    status, httpd_file, app_file = json.loads(out.stdout)
    return status, httpd_file, app_file


def copy_of_sources(dest: Path) -> Path:
    shutil.copytree(native.PACKAGE_DIR, dest / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_suite_runs_the_compiled_request_path() -> None:
    status, httpd_file, app_file = probe()
    assert status.startswith("compiled ("), f"scripts/setup.sh did not compile the request path: {status}"
    assert httpd_file.endswith(SUFFIX) and app_file.endswith(SUFFIX)
    # partner: switched off, the same modules run from their sources
    status, httpd_file, app_file = probe({"UOMP_NATIVE": "0"})
    assert status == "plain Python (UOMP_NATIVE=0)"
    assert httpd_file == str(native.PACKAGE_DIR / "httpd.py")


def test_a_build_serves_only_the_sources_it_was_made_from(tmp_path: Path) -> None:
    # the same bytes with other modification times (a fresh checkout): found by its content
    same = copy_of_sources(tmp_path / "same")
    status, httpd_file, _ = probe(pythonpath=same)
    assert status.startswith("compiled (") and httpd_file.endswith(SUFFIX)
    # one byte more in a compiled module, or in one it was type-checked against: plain Python
    for edited in ("httpd.py", "errors.py"):
        tree = copy_of_sources(tmp_path / edited)
        with (tree / "gateway" / edited).open("a") as fh:
            fh.write("\n# edited after the build\n")
        status, httpd_file, app_file = probe(pythonpath=tree)
        assert status.startswith("plain Python (no build of these sources"), (edited, status)
        assert httpd_file == str(tree / "gateway" / "httpd.py") and app_file.endswith("app.py")


def test_an_incomplete_or_unreadable_build_is_not_used(tmp_path: Path) -> None:
    hit = native.find()
    assert hit is not None, native.status
    builds = tmp_path / "builds"
    env = {"UOMP_NATIVE_DIR": str(builds)}
    build = builds / hit[0].name
    shutil.copytree(hit[0], build)
    assert probe(env)[0].startswith("compiled (")  # partner: the whole copy serves
    app_so = next(build.rglob("app" + SUFFIX))
    app_so.rename(app_so.with_suffix(".gone"))
    assert probe(env)[0].startswith("plain Python (no build")
    app_so.with_suffix(".gone").rename(app_so)
    manifest = build / native.MANIFEST
    manifest.write_text(manifest.read_text()[:-20])  # cut short
    assert probe(env)[0].startswith("plain Python (no build")
    assert probe({"UOMP_NATIVE_DIR": str(tmp_path / "nowhere")})[0].startswith("plain Python (no build")


def test_uomp_native_status_and_build_say_what_runs() -> None:
    status = subprocess.run(
        [sys.executable, "-m", "gateway.cli.native", "status"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0 and status.stdout.startswith("compiled (")
    built = subprocess.run(
        [sys.executable, "-m", "gateway.cli.native", "build"], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0 and built.stdout.startswith("native: up to date (")
    off = subprocess.run(
        [sys.executable, "-m", "gateway.cli.native", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "UOMP_NATIVE": "0"},
    )
    assert off.returncode == 1 and off.stdout.strip() == "plain Python (UOMP_NATIVE=0)"


def _uomp(home: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*UOMP, "--home", str(home), *args], capture_output=True, text=True, timeout=60, check=True, env=env
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["compiled", "plain"])
async def test_the_appliance_answers_the_same_compiled_and_plain(tmp_path: Path, mode: str) -> None:
    env = {**os.environ, "UOMP_NATIVE": "1" if mode == "compiled" else "0"}
    home = tmp_path / "home"

    def uomp(h: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return _uomp(h, *args, env=env)

    uomp(home, "init")
    uomp(home, "memory", "add", "preference.theme", "--value", '"dark"', "--tag", "preference", "--sensitivity", "low")
    uomp(home, "memory", "add", "identity.name", "--value", '"Ada"', "--tag", "identity", "--sensitivity", "high")
    doctor = subprocess.run([*UOMP, "--home", str(home), "doctor"], capture_output=True, text=True, env=env)
    want = "request path compiled (" if mode == "compiled" else "request path plain Python (UOMP_NATIVE=0)"
    assert want in doctor.stdout, doctor.stdout
    proc = subprocess.Popen(
        [*UOMP, "--home", str(home), "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        m = re.search(r"https://127\.0\.0\.1:(\d+)", read_until(proc, "gateway: "))
        assert m
        port = int(m.group(1))
        ctx, headers = remote_calendar(uomp, home, tmp_path, port)
        base = f"https://localhost:{port}/v1/memory/"
        answers: list[tuple[int, Any]] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            for key, hdrs in (
                ("preference.theme", headers),  # granted
                ("identity.name", headers),  # not granted
                ("preference.theme", {**headers, "Authorization": headers["Authorization"] + "x"}),  # forged
                ("preference.theme", {k: v for k, v in headers.items() if k != "Authorization"}),  # no token
            ):
                async with s.get(base + key, headers=hdrs) as resp:
                    body = await resp.json()
                    answers.append((resp.status, body.get("value") or body["error"]["code"]))
        assert answers == [(200, "dark"), (403, "ACCESS_DENIED"), (401, "INVALID_TOKEN"), (401, "INVALID_TOKEN")]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0


def test_a_build_found_by_its_bytes_gets_the_new_stamp_from_build(tmp_path: Path) -> None:
    """A checkout that touched the sources without changing them finds its build by hashing their
    bytes; ``build`` then records their new stamp, so later starts need one ``stat`` per file only."""
    hit = native.find()
    assert hit is not None, native.status
    build = tmp_path / "builds" / hit[0].name
    shutil.copytree(hit[0], build)
    manifest = build / native.MANIFEST
    doc = json.loads(manifest.read_text())
    doc["stamp"] = "touched-since"
    manifest.write_text(json.dumps(doc))
    env = {**os.environ, "UOMP_NATIVE_DIR": str(build.parent)}
    assert probe({"UOMP_NATIVE_DIR": str(build.parent)})[0].startswith("compiled (")  # by its bytes
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli.native", "build"], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0 and out.stdout.startswith("native: up to date ("), out.stderr
    assert json.loads(manifest.read_text())["stamp"] == native.stamp()
    assert not (build / (native.MANIFEST + ".tmp")).exists()


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower() for r in reqs}


def _not_installed_by_run_sh() -> set[str]:
    """The distributions of pyproject.toml's extras that ``scripts/run.sh`` (``.[native]``) leaves
    out: every extra's, minus the required dependencies and the ``native`` extra's."""
    project = tomllib.loads((native.PACKAGE_DIR.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    wanted = _requirement_names(project["dependencies"]) | _requirement_names(extras["native"])
    return {n for reqs in extras.values() for n in _requirement_names(reqs)} - wanted


def _python_without_extras(tmp_path: Path) -> Path:
    """An interpreter that sees this virtualenv's packages except those of the extras that
    ``scripts/run.sh`` does not install (:func:`_not_installed_by_run_sh`; what they depend on stays
    visible): a virtualenv whose one ``.pth`` names a directory of links to every other entry of
    site-packages."""
    from importlib.metadata import PackageNotFoundError, distribution

    hidden: set[str] = set()
    for name in _not_installed_by_run_sh():
        try:
            dist = distribution(name)
        except PackageNotFoundError:  # (an extra that does not install on this platform)
            continue
        hidden |= {f.parts[0] for f in dist.files or () if not f.parts[0].startswith("..")}
    assert "keyring" in hidden
    site = Path(sysconfig.get_paths()["purelib"])
    shown = tmp_path / "shown"
    shown.mkdir()
    for entry in site.iterdir():
        if entry.name not in hidden and not entry.name.endswith(".pth"):
            (shown / entry.name).symlink_to(entry)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    inner = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    Path(inner, "shown.pth").write_text(f"{shown}\n", encoding="utf-8")
    return py


def test_the_build_type_checks_without_the_optional_extras(tmp_path: Path) -> None:
    """``scripts/run.sh`` installs the required dependencies only; the build's type check (what
    mypyc compiles from) must not need keyring, redis, web3 or the others."""
    py = _python_without_extras(tmp_path)
    probe = subprocess.run([str(py), "-c", "import keyring"], capture_output=True, timeout=60)
    assert probe.returncode != 0  # the extras are really out of sight
    ok = subprocess.run([str(py), "-c", "import aiohttp, httptools, mypy_extensions"], capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr

    def check(args: list[str]) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "mypy", "--python-executable", str(py), "--cache-dir", str(tmp_path / "c"), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=native.PACKAGE_DIR.parent)

    out = check(native.build_args())
    assert out.returncode == 0, out.stdout[-2000:]
    # partner: the modules alone, without the build's options, need the extras
    bare = check([a for a in native.build_args() if not a.startswith("-")])
    assert bare.returncode == 1 and 'module named "keyring"' in bare.stdout
