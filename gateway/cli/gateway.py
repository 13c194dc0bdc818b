"""``uomp gateway serve`` (the gateway alone) and ``uomp gateway start`` (the appliance).

``start`` is one supervised process tree: this process (the gateway and the supervisors), the
guard child and, with ``--tunnel``, the ``cloudflared`` child (:mod:`gateway.tunnel`). It holds
the data directory's appliance lock (a second start is refused, naming the first), prints what a
first run created, and once ready the local and public URLs, the endpoints it accepts and the next
commands. Each new tunnel URL is accepted at once, recorded in ``gateway/addresses.json`` (see
:mod:`gateway.appliance`), and announced.

``start`` runs the guard in a child process, supervised by :class:`gateway.supervisor.GuardProcess`
(health-checked over its socket, restarted with backoff if it dies or stops answering; see that
module), and the gateway in this one, so each gets its own core and event loop. Here:

* before anything starts: the gateway's (and tunnel origin's, and Local Profile's) bind address is
  checked, and a live server on ``guard.sock`` is refused (a stale socket file is removed);
* the child is spawned first, and this process loads the gateway's server code (and the dashboard's,
  when enabled) while the child boots; the gateway starts only once the child answers
  ``GET /v1/health``;
* SIGTERM / SIGINT: the gateway stops (in-flight requests finish), then the child;
  SIGHUP reloads the gateway's certificates, CRL and keys and is forwarded to the child;
* the child's output (its log lines) is relayed to this process's stderr; the supervisor's view
  of the child (pid, restarts, last reason) goes into the gateway's status file
  (``$UOMP_HOME/gateway/status.json``) and metrics.

Longer than ~500 lines on purpose: ``uomp gateway start`` supervises the guard, the gateway and the
tunnel as one appliance; its settings, banner and shutdown belong together.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import appliance, eventloop, memtrace
from gateway.cli.guard import guard_config
from gateway.cli.main import paths_from
from gateway.config import GatewayConfig, GuardConfig, Paths, TunnelSettings, load_section
from gateway.errors import ErrorCode, UompError
from gateway.supervisor import GuardProcess, guard_command


def _port_flag(value: int | None, flag: str, *, low: int) -> None:
    if value is not None and not (low <= value <= 65535):
        raise UompError(
            ErrorCode.CONFIG_ERROR,
            f"{flag} {value} is out of range; use 1-65535" + (" (0 = any free port)" if low <= 0 else ""),
        )


def gateway_config(args: argparse.Namespace, paths: Paths) -> GatewayConfig:
    """The gateway settings from the config file with the command's flags on top, the flags checked."""
    overrides: dict[str, Any] = {}
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit():
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"--listen {args.listen!r} is not HOST:PORT; use e.g. 127.0.0.1:9443"
            )
        _port_flag(int(port), "--listen port", low=0)
        overrides["listen_host"] = host.strip("[]")
        overrides["listen_port"] = int(port)
    if args.upstream:
        overrides["upstream"] = args.upstream
    if args.endpoint:
        overrides["endpoints"] = list(args.endpoint)
    if getattr(args, "tunnel_endpoint", None):
        overrides["tunnel_endpoints"] = list(args.tunnel_endpoint)
    if args.force_non_loopback:
        overrides["allow_non_loopback"] = True
    if getattr(args, "uplink_listen", None):
        host, _, port = args.uplink_listen.rpartition(":")
        if not host or not port.isdigit():
            raise UompError(
                ErrorCode.CONFIG_ERROR, f"--uplink-listen {args.uplink_listen!r} is not HOST:PORT; e.g. 0.0.0.0:9444"
            )
        _port_flag(int(port), "--uplink-listen port", low=0)
        overrides["uplink_listen_host"] = host.strip("[]")
        overrides["uplink_listen_port"] = int(port)
    _port_flag(args.metrics_port, "--metrics-port", low=0)
    _port_flag(args.tunnel_origin_port, "--tunnel-origin-port", low=0)
    if args.metrics_port is not None:
        overrides["metrics_port"] = args.metrics_port
    if args.tunnel_origin_port is not None:
        overrides["tunnel_origin_port"] = args.tunnel_origin_port
    return load_section(GatewayConfig, "gateway", file=paths.config_file, overrides=overrides)


def tunnel_settings(args: argparse.Namespace, paths: Paths) -> TunnelSettings:
    """The tunnel settings from the config file with the command's flags on top."""
    overrides: dict[str, Any] = {}
    if getattr(args, "tunnel", None):
        overrides["mode"] = args.tunnel
    if getattr(args, "cloudflared", None):
        overrides["cloudflared"] = args.cloudflared
    if getattr(args, "tunnel_hostname", None):
        overrides["hostname"] = args.tunnel_hostname
    return load_section(TunnelSettings, "tunnel", file=paths.config_file, overrides=overrides)


def tunnel_token(t: TunnelSettings) -> str:
    """A named tunnel's token: ``UOMP_TUNNEL_TOKEN`` or ``token_file`` (0600), never argv or config."""
    env = os.environ.get("UOMP_TUNNEL_TOKEN", "").strip()
    if env:
        return env
    if not t.token_file:
        raise UompError(
            ErrorCode.TUNNEL_ERROR,
            f"a {t.mode} tunnel needs its token; put it in a file readable only by "
            'you and set [tunnel] token_file = "/path" (chmod 600), or set UOMP_TUNNEL_TOKEN',
        )
    p = Path(t.token_file).expanduser()
    try:
        st = p.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UompError(
                ErrorCode.TUNNEL_ERROR,
                f"the tunnel token file {p} is readable by others (mode {st.st_mode & 0o777:o}); run chmod 600 {p}",
            )
        token = p.read_text().strip()
    except OSError as exc:
        raise UompError(
            ErrorCode.TUNNEL_ERROR, f"cannot read the tunnel token file {p} ({exc.strerror}); check [tunnel] token_file"
        ) from None
    if not token:
        raise UompError(
            ErrorCode.TUNNEL_ERROR,
            f"the tunnel token file {p} is empty; paste the token from the "
            "Cloudflare dashboard (Zero Trust > Networks > Tunnels) into it",
        )
    return token


def check_tunnel(t: TunnelSettings) -> None:
    """TUNNEL_ERROR for a tunnel setting that cannot work (a named tunnel without its host name or token)."""
    if t.mode in ("named", "tcp"):
        if not t.hostname:
            raise UompError(
                ErrorCode.TUNNEL_ERROR,
                f"a {t.mode} tunnel needs its public host name; pass --tunnel-hostname or set [tunnel] hostname",
            )
        tunnel_token(t)


# ----------------------------------------------------------------------------- running


def preflight(paths: Paths, gcfg: GatewayConfig, guard_cfg: GuardConfig | None, *, serve_tcp: bool) -> None:
    """Everything that must be refused before any process or listener starts."""
    from gateway.netutil import check_bind, claim_socket_path

    check_bind(gcfg.listen_host, gcfg.allow_non_loopback, "the gateway")
    appliance.check_port_free(gcfg.listen_host, gcfg.listen_port, "the gateway", "--listen HOST:PORT")
    if gcfg.tunnel_origin_port >= 0:
        check_bind(gcfg.tunnel_origin_host, False, "the tunnel-origin listener")
        appliance.check_port_free(
            gcfg.tunnel_origin_host, gcfg.tunnel_origin_port, "the tunnel-origin listener", "--tunnel-origin-port PORT"
        )
    if gcfg.metrics_port > 0:
        appliance.check_port_free("127.0.0.1", gcfg.metrics_port, "the metrics listener", "--metrics-port PORT")
    if guard_cfg is not None:
        if serve_tcp:
            check_bind(guard_cfg.tcp_host, guard_cfg.allow_non_loopback, "the guard's Local Profile listener")
            appliance.check_port_free(
                guard_cfg.tcp_host,
                guard_cfg.tcp_port,
                "the guard's Local Profile listener",
                "[guard] tcp_port (or --no-local-port)",
            )
        claim_socket_path(paths.guard_sock)  # a live guard there: refuse; a stale file: removed


def _say(text: str = "") -> None:
    print(text, flush=True)


def _dashboard_line(base_url: str, ttl: float, mint: Callable[[], str], terminal: bool) -> str:
    """What ``gateway start`` says of its dashboard. The one-time login link is a credential: it is
    printed only to a terminal. Under systemd, Docker or a pipe, stdout is kept in a journal or a
    log, so the line says how to get one instead (``uomp dashboard``), and no link is minted."""
    if terminal:
        return (
            f"dashboard: {base_url} (loopback only); one-time login link, valid {ttl:g} s: {mint()}  "
            "('uomp dashboard' prints a new one)"
        )
    return (
        f"dashboard: {base_url} (loopback only); 'uomp dashboard' prints a one-time login link (none "
        "printed here: this output is not a terminal and may be kept in a log)"
    )


async def _run(
    paths: Paths,
    gcfg: GatewayConfig,
    *,
    with_guard: bool,
    args: argparse.Namespace,
    tunnel: TunnelSettings | None = None,
    lock: appliance.ApplianceLock | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    guard: GuardProcess | None = None
    guard_up: asyncio.Task[None] | None = None
    serve_tcp = not getattr(args, "no_local_port", False)
    tmode = tunnel.mode if tunnel is not None else "none"
    if tmode in ("quick", "named") and gcfg.tunnel_origin_port < 0:
        gcfg = dataclasses.replace(gcfg, tunnel_origin_port=0)  # the tunnel's origin: any free loopback port
    gcfg_guard = guard_config(args, paths) if with_guard else None
    if with_guard:
        preflight(paths, gcfg, gcfg_guard, serve_tcp=serve_tcp)
        command = guard_command(
            paths,
            serve_tcp=serve_tcp,
            verbose=bool(getattr(args, "verbose", False)),
            force_non_loopback=bool(args.force_non_loopback),
        )
        guard = GuardProcess(
            paths,
            command,
            health_interval=gcfg.guard_health_interval_seconds,
            health_timeout=gcfg.guard_health_timeout_seconds,
            health_failures=gcfg.guard_health_failures,
            output=_relay_line,
        )
        guard_up = loop.create_task(guard.start())
        await _spawned(guard, guard_up)
    try:
        # While the guard child boots (its own interpreter, imports and databases), this process
        # loads what needs no guard: the gateway's server code and, when enabled, the dashboard's.
        # The gateway binds only once the guard answers its health check (``await guard_up``).
        from gateway.remote.server import GatewayRunner
        from gateway.tunnel import TunnelConfig, TunnelSupervisor

        dash_cfg = _dashboard_config(paths) if with_guard else None
        gw = GatewayRunner(paths, gcfg)
        if guard_up is not None:
            await guard_up
    except BaseException:
        if guard_up is not None and not guard_up.done():
            guard_up.cancel()  # GuardProcess.start stops the child it spawned
            with contextlib.suppress(BaseException):
                await guard_up
        if guard is not None:
            await guard.stop()
        raise
    if guard is not None:
        gw.status_sources["guard"] = guard.status  # into $UOMP_HOME/gateway/status.json
        guard.on_restart = gw.guard_restarted  # metrics and the status file
        guard.on_health = gw.guard_checked  # one probe of guard.sock serves the gateway's monitor too
    sup: TunnelSupervisor | None = None
    try:
        try:
            await gw.start()
        except OSError as exc:
            raise appliance.port_error(
                gcfg.listen_host, gcfg.listen_port, "the gateway", "--listen HOST:PORT", exc
            ) from None
        assert gw.state is not None and gw.port is not None
        if guard is not None and gw.monitor is not None:
            gw.monitor.on_suspect = guard.check_soon  # a request to the guard failed: the supervisor looks now
        state = gw.state
        _anchor_metrics(paths, state.metrics)
        if gcfg.listen_port == 0:  # the placeholder audiences of "any free port" are not addresses
            for e in appliance.local_urls(0):
                state.discard_endpoint(e)
        # one source of truth: everything recorded for this home is accepted, each URL on its own
        # listener (a quick/named tunnel's URL on the tunnel origin; a tcp tunnel ends in mTLS)
        recorded = appliance.load_addresses(paths)["tunnel"] or {}
        tunnel_at = recorded.get("url") if recorded.get("mode") in ("quick", "named") else None
        for url in appliance.accepted_endpoints(paths, gcfg, gw.port):
            state.add_endpoint(url, listener="tunnel" if url == tunnel_at else "mtls")
        if tunnel is not None and tmode != "none":
            sup = _tunnel_supervisor(paths, gw, tunnel, lock, TunnelConfig, TunnelSupervisor)
            gw.status_sources["tunnel"] = sup.state.as_dict
            sup.start()
            await _wait_tunnel(sup, tunnel.ready_wait_seconds)
    except BaseException:
        if sup is not None:
            await sup.stop()
        await gw.stop()
        if guard is not None:
            await guard.stop()
        raise

    dash = await _start_dashboard(paths, dash_cfg) if dash_cfg is not None else None

    def _stop() -> None:
        if stop.is_set():  # a second Ctrl-C / SIGTERM while draining: say so, keep draining
            _say("already stopping: in-flight requests are finishing (SIGKILL aborts them)")
            return
        if guard is not None:
            guard.stopping = True  # at once: a child that exits from the same Ctrl-C is not restarted
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _stop)

    def _hup() -> None:
        loop.run_in_executor(None, gw.reload)  # file reads and an fsync: off the event loop
        if guard is not None:
            guard.send_hup()

    loop.add_signal_handler(signal.SIGHUP, _hup)
    if guard is not None:
        guard.supervise()
    info = _run_info(paths, gcfg, gw, guard, sup)
    if dash is not None:
        info["listeners"]["dashboard"] = dash.base_url
    if lock is not None:
        lock.write(info)
    _banner(paths, gcfg, gw, guard, sup, info, with_guard=with_guard)
    if dash is not None:
        _say(_dashboard_line(dash.base_url, dash.cfg.login_ttl_seconds, dash.login_link, sys.stdout.isatty()))
    eventloop.release_free_heap()  # what start-up freed goes back to the system (an idle gateway keeps little)
    try:
        await stop.wait()
    finally:
        loop.remove_signal_handler(signal.SIGHUP)
        _say("stopping: finishing in-flight requests, then the tunnel and the guard")
        try:
            if dash is not None:
                await dash.stop()
            if sup is not None:
                await sup.stop()  # no new requests through the tunnel
            await gw.stop()  # in-flight requests finish
            if guard is not None:
                await guard.stop()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a signal during the drain only says so (above)
                loop.remove_signal_handler(sig)


def _tunnel_supervisor(
    paths: Paths, gw: Any, t: TunnelSettings, lock: appliance.ApplianceLock | None, config_cls: Any, sup_cls: Any
) -> Any:
    origin = f"http://127.0.0.1:{gw.tunnel_port}" if gw.tunnel_port else ""
    token = tunnel_token(t) if t.mode in ("named", "tcp") else None
    tc = config_cls(
        mode=t.mode,
        origin_url=origin,
        cloudflared=t.cloudflared or None,
        token=token,
        hostname=t.hostname or None,
        url_timeout_seconds=t.url_timeout_seconds,
        backoff_initial_seconds=t.backoff_initial_seconds,
        backoff_max_seconds=t.backoff_max_seconds,
        rate_limit_backoff_seconds=t.rate_limit_backoff_seconds,
        stop_timeout_seconds=t.stop_timeout_seconds,
        private_home=paths.cloudflared_home,
    )
    holder: dict[str, Any] = {}

    async def on_url(new: str, old: str | None) -> None:
        if gw.state is not None:
            # accepted before anyone can learn the URL from us, on the listener the tunnel ends at
            gw.state.add_endpoint(new, listener="tunnel" if t.mode in ("quick", "named") else "mtls")
        await asyncio.to_thread(appliance.set_tunnel, paths, t.mode, new)
        if lock is not None and "sup" in holder:
            info = _run_info(paths, gw.cfg, gw, None, holder["sup"])
            await asyncio.to_thread(lock.write, info)
        if gw.monitor is not None:
            await gw.monitor.write_status(force=True)  # uomp status sees the new URL at once
        if old is not None:
            _say(
                f"tunnel: the public URL changed: {new} (was {old}). It is accepted now. Agents that used the "
                f"old URL must be given the new one: uomp authorize AGENT_DIR --remote --gateway-url {new} --yes "
                "(a named tunnel keeps one URL: --tunnel named)"
            )

    def on_state(_state: Any) -> None:
        if gw.monitor is not None:
            gw.monitor.report_changed()  # uomp status sees missing / restarting / rate-limited at once

    sup = sup_cls(tc, on_url=on_url, on_state=on_state)
    holder["sup"] = sup
    return sup


async def _wait_tunnel(sup: Any, seconds: float) -> None:
    """Until the tunnel has a URL, is known missing, or ``seconds`` pass (it keeps trying after)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, seconds)
    while loop.time() < deadline:
        if sup.state.public_url or sup.state.status == "missing":
            return
        await asyncio.sleep(0.05)


def _run_info(paths: Paths, gcfg: GatewayConfig, gw: Any, guard: GuardProcess | None, sup: Any) -> dict[str, Any]:
    import time

    listeners = {"mtls": f"https://{gcfg.listen_host}:{gw.port}"}
    if gw.tunnel_port:
        listeners["tunnel_origin"] = f"http://{gcfg.tunnel_origin_host}:{gw.tunnel_port}"
    if gw.metrics_port:
        listeners["metrics"] = f"http://127.0.0.1:{gw.metrics_port}/metrics"
    if gw.uplink_port is not None:  # a VPS gateway: its guard dials in here
        listeners["uplink"] = f"https://{gcfg.uplink_listen_host}:{gw.uplink_port}"
    else:
        listeners["guard_socket"] = f"unix:{paths.guard_sock}"
    if guard is not None and guard.tcp_url:
        listeners["local_profile"] = guard.tcp_url
    live = set(gw.state.endpoints) if gw.state is not None else set()
    # authorize's default audience first: the URL a user copies is the one tokens are made for
    first = (appliance.public_urls(paths, gcfg) or appliance.local_urls(gw.port))[0]
    ordered = [first, *appliance.accepted_endpoints(paths, gcfg, gw.port)]
    endpoints = [u for i, u in enumerate(ordered) if u in live and u not in ordered[:i]]
    endpoints += sorted(live - set(endpoints))
    return {
        "pid": os.getpid(),
        "started_at": appliance.iso(time.time()),
        "home": str(paths.home),
        "listeners": listeners,
        "local_urls": appliance.local_urls(gw.port),
        "public_urls": appliance.public_urls(paths, gcfg),
        "tunnel": sup.state.as_dict() if sup is not None else None,
        "endpoints": endpoints,
    }


def _anchor_metrics(paths: Paths, metrics: Any) -> None:
    """The anchoring backlog per state into the gateway's metrics, when [anchor] names a chain."""
    from gateway.config import AnchorConfig

    try:
        if load_section(AnchorConfig, "anchor", file=paths.config_file).backend == "none":
            return
    except UompError:
        return
    from gateway.ledger.anchoring import counts_of  # (the anchoring code only when a chain is named)

    metrics.anchor_state = lambda: counts_of(paths.audit_db)


def _anchor_warnings(paths: Paths) -> None:
    from gateway.config import AnchorConfig

    try:
        acfg = load_section(AnchorConfig, "anchor", file=paths.config_file)
    except UompError:
        return  # the guard refuses the section at its start, with the reason
    if acfg.backend == "none":
        return  # (no warnings, and the anchor backends' code stays unloaded)
    from gateway.anchor.ops import rpc_warnings

    for w in rpc_warnings(acfg.backend, acfg.rpc_url):
        _say(f"anchoring: WARNING: {w}")


def _banner(
    paths: Paths,
    gcfg: GatewayConfig,
    gw: Any,
    guard: GuardProcess | None,
    sup: Any,
    info: dict[str, Any],
    *,
    with_guard: bool,
) -> None:
    # Lines start with a fixed label ("gateway: ", "guard: ", ...): scripts and tests read them.
    _say(f"UOMP {'appliance' if with_guard else 'gateway'} ready (pid {os.getpid()}, data {paths.home})")
    _say(
        f"gateway: https://localhost:{gw.port} (TLS 1.3, client certificates from your agent CA; listening on "
        f"https://{gcfg.listen_host}:{gw.port}, the same endpoint)"
    )
    for url in info["public_urls"]:
        _say(f"public URL: {url} (mTLS)")
    tunnel_public: str | None = None
    if sup is not None:
        st = sup.state
        tunnel_public = st.public_url
        if st.status == "missing":
            _say(
                f"tunnel: {sup.cfg.mode}: NOT RUNNING ({st.last_error}); install cloudflared or set "
                "[tunnel] cloudflared = /path; the gateway keeps serving locally"
            )
        elif tunnel_public:
            kind = {
                "quick": "quick tunnel, DPoP; the URL changes on every restart",
                "named": "named tunnel, DPoP",
                "tcp": "TCP tunnel, end-to-end mTLS via cloudflared access tcp",
            }
            _say(f"public URL: {tunnel_public} ({kind.get(sup.cfg.mode, sup.cfg.mode)})")
        else:
            _say(
                f"tunnel: {sup.cfg.mode}: {st.status}, no public URL yet ({st.last_error or 'waiting'}); "
                "it is announced here when it comes"
            )
    if gw.tunnel_port:
        _say(f"tunnel origin: http://127.0.0.1:{gw.tunnel_port} (plain HTTP on loopback, DPoP required)")
    if guard is not None:
        local = f" and {guard.tcp_url} (Local Profile)" if guard.tcp_url else ""
        _say(f"guard:   unix:{paths.guard_sock}{local} (process {guard.pid}, restarted if it dies)")
    if gw.metrics_port:
        _say(f"metrics: http://127.0.0.1:{gw.metrics_port}/metrics")
    _anchor_warnings(paths)
    _say(f"endpoints (token audiences accepted): {', '.join(info['endpoints'])}")
    home = (
        ""
        if os.environ.get("UOMP_HOME") == str(paths.home)
        or str(paths.home) == str(Path("~/.uomp").expanduser().resolve())
        else f" --home {paths.home}"
    )
    url = (
        tunnel_public
        if tunnel_public and sup is not None and sup.cfg.mode != "tcp"
        else (info["public_urls"][0] if info["public_urls"] else f"https://localhost:{gw.port}")
    )
    _say("next, in another terminal:")
    _say(f"  uomp{home} authorize examples/calendar_agent --remote --gateway-url {url} --out agent-files --yes")
    _say("      # the agent's key, certificate and bundle in agent-files/ (README: the agent side)")
    _say(f"  uomp{home} status                 # what runs, where, and its health")
    _say(f"  uomp{home} audit --limit 20       # what agents asked for and what they got")
    _say("Ctrl-C (or SIGTERM) stops everything; SIGHUP reloads certificates, CRL and keys.")


async def _spawned(guard: GuardProcess, starting: asyncio.Task[None]) -> None:
    """Until ``guard.start()`` has its child process (or ended): the few loop steps it takes to spawn
    it (its pipes connected), each a millisecond apart at most."""
    while guard.proc is None and not starting.done():
        await asyncio.sleep(0.001)


def _dashboard_config(paths: Paths) -> Any:
    """The [dashboard] section when the dashboard is to run, its server's module loaded (its pages'
    and jinja2 at their first request); None when it is disabled (nothing of it loaded) or its
    section is refused (said here)."""
    from gateway.config import DashboardConfig, load_section

    try:
        cfg = load_section(DashboardConfig, "dashboard", file=paths.config_file)
    except UompError as exc:
        _say(f"dashboard: NOT started ({exc.message})")
        return None
    if not cfg.enabled:
        return None
    from gateway.dashboard import server  # noqa: F401  (loaded before it starts)

    return cfg


async def _start_dashboard(paths: Paths, cfg: Any) -> Any:
    """The local dashboard ([dashboard], docs/dashboard.md); a port it cannot have is said, not fatal."""
    from gateway.dashboard.server import start_for_appliance

    try:
        return await start_for_appliance(paths, cfg=cfg)
    except OSError as exc:
        why = appliance.port_error(cfg.host, cfg.port, "the dashboard", "[dashboard] port", exc).message
        _say(f"dashboard: NOT started ({why})")
        return None


def _relay_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace) -> int:
    paths = paths_from(args, needs_init=not getattr(args, "uplink_listen", None))  # a VPS has no signing key
    memtrace.start_if_enabled(paths, "gateway")  # UOMP_TRACEMALLOC=1 only
    eventloop.run(_run(paths, gateway_config(args, paths), with_guard=False, args=args))
    return 0


def _start_vps(paths: Paths, gcfg: GatewayConfig, args: argparse.Namespace, tcfg: TunnelSettings) -> int:
    """The gateway alone, its guard at home behind the uplink: nothing is created here (no signing
    key, no CA key, no memory); the data directory is the one `uomp uplink init` wrote."""
    appliance.check_home_writable(paths.home)
    lock = appliance.ApplianceLock(paths)
    lock.acquire()
    try:
        eventloop.run(_run(paths, gcfg, with_guard=False, args=args, tunnel=tcfg, lock=lock))
    finally:
        lock.release()
    return 0


def _start(args: argparse.Namespace) -> int:
    from gateway import keys

    paths = paths_from(args, needs_init=False)
    gcfg = gateway_config(args, paths)  # bad flags and config refused before anything is written
    tcfg = tunnel_settings(args, paths)
    check_tunnel(tcfg)
    if gcfg.uplink_listen_port >= 0:
        return _start_vps(paths, gcfg, args, tcfg)
    appliance.check_home_writable(paths.home)
    lock = appliance.ApplianceLock(paths)
    lock.acquire()
    try:
        if args.public_url:
            urls = [appliance.normalize_public_url(u, default_port=gcfg.listen_port) for u in args.public_url]
            for url in appliance.add_public_urls(paths, urls):
                _say(f"public URL recorded: {url} (gateway certificate, endpoints and authorize follow it)")
        if appliance.tunnel_url(paths):
            appliance.set_tunnel(paths, tcfg.mode, None)  # the last run's tunnel URL is gone with it
        if paths.private_jwk.exists():  # set up before: what it had must still be there and usable
            from gateway.cli import homefiles

            homefiles.require_intact(paths)
        made = keys.init_home(paths)
        from gateway.cli import home

        for hook in home.INIT_HOOKS:
            made.update(hook(paths))
        created = [what for what, new in made.items() if new]
        if created:
            _say(f"first run: created in {paths.home}: {', '.join(created).replace('_', ' ')}")
        memtrace.start_if_enabled(paths, "gateway")  # UOMP_TRACEMALLOC=1 only
        eventloop.run(_run(paths, gcfg, with_guard=True, args=args, tunnel=tcfg, lock=lock))
    finally:
        lock.release()
    return 0


def _stop(args: argparse.Namespace) -> int:
    """SIGTERM the appliance of this home and wait until it has let go of its lock."""
    import time

    paths = paths_from(args, needs_init=False)
    if not appliance.is_running(paths):
        _say(f"the appliance is not running on {paths.home}")
        return 0
    info = appliance.read_run(paths) or {}
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 1:
        raise UompError(
            ErrorCode.INVALID_STATE,
            f"the appliance on {paths.home} runs but {appliance.run_path(paths)} names "
            "no pid; stop it with Ctrl-C where it runs",
        )
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + args.timeout
    while appliance.is_running(paths):
        if time.monotonic() > deadline:
            raise UompError(
                ErrorCode.INVALID_STATE,
                f"the appliance (pid {pid}) is still stopping after {args.timeout:.0f} s "
                f"(in-flight requests draining); wait, or kill -KILL {pid}",
            )
        time.sleep(0.1)
    _say(f"stopped the appliance (pid {pid})")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="mTLS listener (default 127.0.0.1:9443)")
    p.add_argument(
        "--endpoint",
        action="append",
        metavar="URL",
        help="a URL agents use to reach this gateway; tokens must name one as audience (repeatable; "
        "for a lasting address use --public-url with 'start')",
    )
    p.add_argument(
        "--upstream",
        help="guard to forward to: unix:/path/guard.sock (default $UOMP_HOME/guard.sock) or http://127.0.0.1:PORT",
    )
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument(
        "--tunnel-origin-port",
        type=int,
        metavar="PORT",
        help="also listen on 127.0.0.1:PORT (plain HTTP) for a tunnel such as cloudflared; every request "
        "there needs a DPoP proof (start --tunnel quick|named picks a free port when this is not set); "
        "the tunnel's public URL must be a --tunnel-endpoint (start --tunnel adds it by itself)",
    )
    p.add_argument(
        "--tunnel-endpoint",
        action="append",
        metavar="URL",
        help="the tunnel's public URL (repeatable): the only endpoint the tunnel-origin listener serves; "
        "tokens used through the tunnel name it as audience",
    )
    p.add_argument(
        "--uplink-listen",
        metavar="HOST:PORT",
        help="a gateway on a VPS: the guard is at home and dials in here over mTLS ('uomp guard uplink'; docs/vps.md)",
    )
    p.add_argument(
        "--force-non-loopback",
        action="store_true",
        help="allow --listen on a non-loopback address (needed to accept agents from other hosts)",
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds ``uomp gateway`` to the command line."""
    g = sub.add_parser("gateway", help="the remote gateway (TLS 1.3 + mTLS) for agents on other machines")
    gsub = g.add_subparsers(dest="gateway_command", metavar="ACTION", required=True)
    s = gsub.add_parser("serve", help="run the gateway alone, in front of an already running guard")
    _common(s)
    s.set_defaults(func=_serve, service=True)
    st = gsub.add_parser(
        "start",
        help="run the appliance: init if needed, then the guard (in a child process, "
        "restarted if it dies), the gateway and, with --tunnel, cloudflared",
    )
    _common(st)
    st.add_argument(
        "--no-local-port",
        action="store_true",
        help="do not serve the Local Profile on 127.0.0.1:9374 (Unix socket only)",
    )
    st.add_argument(
        "--public-url",
        action="append",
        metavar="URL",
        help="an address agents use to reach this gateway over mTLS, e.g. https://my-box.example:9443 "
        "(recorded: the gateway certificate, accepted endpoints and authorize's default follow it)",
    )
    st.add_argument(
        "--tunnel",
        choices=("quick", "named", "tcp", "none"),
        help="run cloudflared: quick (a trycloudflare.com URL, DPoP), named (your tunnel's stable host "
        "name, DPoP), tcp (end-to-end mTLS for agents using cloudflared access tcp), none (default; "
        "or [tunnel] mode)",
    )
    st.add_argument("--cloudflared", metavar="PATH", help="the cloudflared binary (default: on PATH)")
    st.add_argument("--tunnel-hostname", metavar="HOST", help="named/tcp tunnels: the tunnel's public host name")
    st.set_defaults(func=_start, service=True)
    sp = gsub.add_parser(
        "stop",
        help="stop the appliance running on this data directory (SIGTERM: in-flight "
        "requests finish, then the tunnel and the guard stop)",
    )
    sp.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to finish (default 60)")
    sp.set_defaults(func=_stop)
