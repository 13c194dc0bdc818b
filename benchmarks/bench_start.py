"""Wall time of the commands a person types: ``uomp --help``, ``uomp status``, ``uomp memory show``,
and ``uomp gateway start`` until it serves, for this tree and (``--baseline PATH``) another one.

    .venv/bin/python benchmarks/bench_start.py [--baseline PATH] [--rounds R]

Each command runs in a fresh interpreter (this virtualenv's Python, the tree on ``PYTHONPATH``
ahead of the editable install: the script prints which ``gateway`` package each tree loaded), on
one throwaway UOMP_HOME under /tmp made by ``uomp init`` with one Memory Item. ``status`` finds no
appliance running (exit 3): what it costs to say so. ``gateway start`` (``--listen 127.0.0.1:0
--no-local-port``) is timed from the spawn to its "gateway: https://" line (printed once it
listens, its guard up), then stopped with SIGTERM; the median time to each step it logs on the way
(guard bound, gateway bound, dashboard bound; the dashboard on any free port; once more with it
disabled) is printed under it, and the CPU seconds of each command (for the start: of its processes
when it is ready). The trees' runs alternate (A B A B ..., ``--rounds`` each); the figure per
command is the median of its rounds, and the ratio this/baseline is taken inside the run. Also: how
many modules each command had loaded and whether any of the heavy ones (aiohttp, cryptography,
web3, starknet_py, jinja2) were among them. Nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import _common as c

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("aiohttp", "cryptography", "web3", "starknet_py", "jinja2")
PROBE = """
import json, sys
sys.argv = ["uomp", *json.loads(sys.argv[1])]
out = sys.argv.pop(-1)
heavy = json.loads(sys.argv.pop(-1))
from gateway.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
import gateway
mods = sorted(sys.modules)
found = [m for m in mods if m.split(".")[0] in heavy]
with open(out, "w") as f:
    json.dump({"rc": rc, "n": len(mods), "heavy": found, "pkg": gateway.__file__}, f)
"""
COMMANDS = {
    "uomp --help": ["--help"],
    "uomp status": ["status"],
    "uomp memory show": ["memory", "show", "bench.key"],
}
START_TIMEOUT = 60.0
# `gateway start` with the home's config.toml: the dashboard on (on any free port: one another
# process holds would leave it out) and off
STARTS = {
    "uomp gateway start (to ready)": "[dashboard]\nport = 0\n",
    "  the same, dashboard disabled": "[dashboard]\nenabled = false\n",
}


def env_for(tree: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["UOMP_HOME"] = str(home)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def tree_cpu(pid: int) -> float:
    """CPU seconds so far of ``pid`` and its live descendants (from /proc: the appliance's processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(parents.get(p, []))
    return total


def run_command(tree: Path, home: Path, argv: list[str]) -> tuple[float, dict[str, object]]:
    fd, out = tempfile.mkstemp(prefix="uomp-start-", suffix=".json")
    os.close(fd)
    try:
        cpu0 = children_cpu()
        t0 = time.perf_counter()
        subprocess.run(
            [c.PYTHON, "-c", PROBE, json.dumps([*argv, json.dumps(HEAVY), out])],
            env=env_for(tree, home),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
            cwd=tree,
        )
        wall = time.perf_counter() - t0
        info = json.loads(Path(out).read_text() or "{}")
        info["cpu"] = children_cpu() - cpu0
    finally:
        os.unlink(out)
    return wall, info


# The start's steps, seen in its output (the guard child's log lines are relayed to stderr): the guard
# bound guard.sock, the gateway its mTLS port, the dashboard its port, and the ready banner.
PHASES = {
    "guard bound": b"guard listening on unix:",
    "gateway bound": b"gateway listening on https://",
    "dashboard bound": b"dashboard: listening on http://",
}
READY = b"gateway: https://"


def gateway_start(tree: Path, home: Path) -> tuple[float, dict[str, float]]:
    """Seconds from the spawn to the ready line, and to each of :data:`PHASES` seen before it (and
    ``cpu``: the CPU seconds its processes had used by then)."""
    cmd = [c.PYTHON, "-m", "gateway.cli.main", "gateway", "start", "--listen", "127.0.0.1:0", "--no-local-port"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env_for(tree, home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tree, bufsize=0
    )
    assert proc.stdout is not None
    buf = b""
    ready = float("nan")
    phases: dict[str, float] = {}
    try:
        while time.perf_counter() - t0 < START_TIMEOUT:
            r, _w, _x = select.select([proc.stdout], [], [], 1.0)
            if not r:
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            now = time.perf_counter() - t0
            for name, marker in PHASES.items():
                if name not in phases and marker in buf:
                    phases[name] = now
            if READY in buf:
                ready = now
                phases["cpu"] = tree_cpu(proc.pid)  # the appliance's processes, at ready
                break
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if ready != ready:
        print(f"warning: {tree}: gateway start did not get ready: {buf[-400:].decode(errors='replace')}")
    return ready, phases


def prepare_home(tree: Path) -> Path:
    home = Path(tempfile.mkdtemp(prefix="uomp-start-", dir="/tmp"))
    for argv in (
        ["init"],
        ["memory", "add", "bench.key", "--value", "1", "--tag", "bench", "--sensitivity", "low"],
    ):
        subprocess.run(
            [c.PYTHON, "-m", "gateway.cli.main", *argv],
            env=env_for(tree, home),
            check=True,
            stdout=subprocess.DEVNULL,
            cwd=tree,
        )
    return home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="an older checkout to measure beside this one")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each command per tree (default 5)")
    ap.add_argument("--no-gateway", action="store_true", help="skip `uomp gateway start`")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 20:
        raise SystemExit("--rounds 1..20")
    trees = {"this": ROOT}
    if args.baseline is not None:
        if not (args.baseline / "gateway" / "__init__.py").exists():
            raise SystemExit(f"--baseline {args.baseline}: not a checkout of this project")
        trees["baseline"] = args.baseline.resolve()
    print(f"bench_start: {c.machine_line()}")
    home = prepare_home(ROOT)
    names = [*COMMANDS, *([] if args.no_gateway else list(STARTS))]
    walls: dict[str, dict[str, list[float]]] = {t: {n: [] for n in names} for t in trees}
    infos: dict[str, dict[str, dict[str, object]]] = {t: {} for t in trees}
    steps: dict[str, dict[str, list[float]]] = {t: {p: [] for p in PHASES} for t in trees}
    cpus: dict[str, dict[str, list[float]]] = {t: {n: [] for n in names} for t in trees}
    try:
        for _ in range(args.rounds):
            for name in names:
                for label, tree in trees.items():  # A B A B: drift hits both trees alike
                    if name in COMMANDS:
                        wall, info = run_command(tree, home, COMMANDS[name])
                        infos[label][name] = info
                        cpus[label][name].append(float(info["cpu"]))  # type: ignore[arg-type]
                    else:
                        (home / "config.toml").write_text(STARTS[name])
                        wall, seen = gateway_start(tree, home)
                        for phase in PHASES if name == next(iter(STARTS)) else ():  # steps: dashboard on
                            if phase in seen:
                                steps[label][phase].append(seen[phase])
                        if "cpu" in seen:
                            cpus[label][name].append(seen["cpu"])
                    walls[label][name].append(wall)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    for label in trees:
        pkg = next((i.get("pkg") for i in infos[label].values() if i.get("pkg")), "?")
        print(f"{label}: gateway package from {pkg}")
    print(f"\n{'command':34} " + " ".join(f"{t + ' s':>12}" for t in trees) + ("    ratio" if len(trees) > 1 else ""))
    for name in names:
        med = {t: statistics.median(walls[t][name]) for t in trees}
        line = f"{name:34} " + " ".join(f"{med[t]:12.3f}" for t in trees)
        if len(trees) > 1:
            line += f"    x{med['this'] / med['baseline']:.2f}"
        print(line)
    if not args.no_gateway:
        print(
            "  gateway start (dashboard on), median seconds to each step: "
            + "; ".join(
                f"{t} " + ", ".join(f"{p} {statistics.median(v):.3f}" for p, v in steps[t].items() if v) for t in trees
            )
        )
    # CPU seconds do not grow with the machine's load as wall time does: on a busy machine they say
    # whether a change saved work or only reordered it (running side by side needs a free core)
    print(f"\n{'CPU seconds (user + system)':34} " + " ".join(f"{t + ' s':>12}" for t in trees))
    for name in names:
        line = f"{name:34} " + " ".join(
            f"{statistics.median(cpus[t][name]) if cpus[t][name] else float('nan'):12.3f}" for t in trees
        )
        print(line)
    print("\nmodules loaded (heavy ones among them):")
    for name in COMMANDS:
        parts = []
        for t in trees:
            info = infos[t][name]
            heavy = sorted({str(h).split(".")[0] for h in info.get("heavy", [])})  # type: ignore[attr-defined]
            parts.append(f"{t} {info.get('n')} ({', '.join(heavy) or 'none'})")
        print(f"  {name:32} " + "; ".join(parts))


if __name__ == "__main__":
    main()
