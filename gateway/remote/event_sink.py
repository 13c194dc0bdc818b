"""The gateway's events into the guard's one log, with a durable local spool.

A request the guard answers is recorded by the guard alone (the gateway hands over its fields as
verified contract headers, :mod:`gateway.contract`). What the gateway decides alone (its refusals,
rejected TLS handshakes, upstream failures) goes to the guard's internal route
``POST /v1/internal/events`` on the Unix socket through :class:`EventSink`:

* :meth:`EventSink.append` queues an event and returns a future; the request's answer waits for it
  (acknowledged = durable). Everything queued within one event-loop tick leaves in *one* internal
  request (at most :data:`gateway.contract.MAX_INTERNAL_EVENTS` events and
  :data:`gateway.contract.MAX_INTERNAL_EVENTS_BYTES` bytes of body, the guard's limit on that route;
  more makes more requests), which the guard writes in one group commit: a flood of refusals costs
  one round trip and one fsync per batch (:attr:`EventSink.requests_sent` counts the internal requests).
* Events without a verified session carry a ``source`` (the client address) and pass a per-source
  token bucket; beyond the rate they are *counted*, not written, and the counts land as one
  ``gateway_events_suppressed`` event at most every ``summary_interval`` seconds.
* Every event has an id (``gw_`` + 32 hex digits) given here, so the guard writes it once however
  often it is sent (a lost answer, a replay).

The guard unreachable (or refusing to write): the batch goes to the gateway's durable spool
``$UOMP_HOME/gateway/access.jsonl`` (the hash-chained, group-committed
:class:`gateway.remote.access_log.AccessLog`) and the futures resolve once it is fsynced there. The
spool is replayed into the guard's log, oldest first, as soon as the guard answers again (before
any newer batch, and by a timer every :data:`REPLAY_INTERVAL_SECONDS` that runs only while the
spool holds events: an empty spool is waited on, not polled); ``access.replayed`` holds
the spool sequence number replayed so far (written atomically after the guard acknowledged).
A crash between the guard's answer and that write replays a batch again: the ids make that a no-op.
When neither the guard nor the spool can take an event, the futures fail with
``STORE_UNAVAILABLE`` and the request is answered 503.

A batch the guard *refuses* (413: too large, 400: malformed; as opposed to unreachable or busy,
which is retried with a backoff of at most :data:`REPLAY_BACKOFF_MAX_SECONDS`) is logged, counted
(:attr:`EventSink.batches_refused`) and split in halves, down to one event. One event the guard
still refuses can never be written, so it must not hold back the rest: it is *set aside*, first a
line in ``access.setaside.jsonl`` (seq, id, status, code, size; fsynced; never the event's fields),
then a ``gateway_event_set_aside`` event in the guard's log naming the spool seq, then the marker
moves past it. The event itself stays in the spool (the hash-chained file keeps it for as long as
its retention), :attr:`EventSink.events_set_aside` counts it and a warning names its seq and code.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway import contract
from gateway.durable import RefusalTally, fault_point
from gateway.errors import ErrorCode, UompError
from gateway.fsutil import atomic_write, fsync_dir
from gateway.remote.access_log import GAP_TYPE, MAX_SOURCES, SUPPRESSED_TYPE, AccessLog, SourceBuckets
from gateway.remote.guard_client import Forwarder

log = logging.getLogger("uomp.gateway")

REPLAY_INTERVAL_SECONDS = 1.0
REPLAY_BACKOFF_MAX_SECONDS = 10.0  # the replay timer backs off to this while the guard does not answer
SUPPRESSED_ACTION = "gateway_events_suppressed"
SET_ASIDE_ACTION = "gateway_event_set_aside"
REFUSED_STATUSES = (400, 413)  # the guard refused the batch's content: split it, never retry it whole
_BODY_OVERHEAD = len(json.dumps({"events": []}))
_SAFE_ID = re.compile(r"[A-Za-z0-9_]{1,64}")
SPOOL_FIELDS = ("type", "seq", "timestamp", "prev")  # what the spool adds to an event


def new_event_id(now: float | None = None) -> str:
    """``gw_`` + 12 hex digits of the time in milliseconds + 20 random hex digits: unique and
    unguessable (80 random bits), and side by side in the log's ``id`` index with the other events
    of the same moment (:func:`gateway.contract.event_id_time`)."""
    return f"gw_{contract.event_id_time(now)}{secrets.token_hex(10)}"


class Refused(UompError):
    """The guard answered 400 or 413 to a batch: its content, not the guard's state, is the problem."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(ErrorCode.STORE_UNAVAILABLE, f"the guard refused the events ({status} {code})")
        self.http_status = status
        self.guard_code = code


def wire_size(event: Mapping[str, Any]) -> int:
    """Bytes ``event`` takes in an internal request's body (as :meth:`Forwarder.json_call` encodes
    it), with the separator before it."""
    return len(json.dumps(event)) + 2


def fits(sizes: Sequence[int]) -> int:
    """How many of the leading events (their :func:`wire_size`) make one internal request: at most
    :data:`~gateway.contract.MAX_INTERNAL_EVENTS` and :data:`~gateway.contract.MAX_INTERNAL_EVENTS_BYTES`
    of body; at least one (an event too large on its own is sent alone and refused as such)."""
    total = _BODY_OVERHEAD
    n = 0
    for size in sizes[: contract.MAX_INTERNAL_EVENTS]:
        total += size
        if n and total > contract.MAX_INTERNAL_EVENTS_BYTES:
            break
        n += 1
    return max(1, n) if sizes else 0


class EventSink:
    """See the module docstring."""

    def __init__(
        self,
        forwarder: Forwarder,
        spool: AccessLog,
        *,
        unauth_events_per_second: float = 2.0,
        unauth_burst: float = 20.0,
        summary_interval_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.forwarder = forwarder
        self.spool = spool
        self.clock = clock
        self.summary_interval = float(summary_interval_seconds)
        self._buckets = SourceBuckets(unauth_events_per_second, unauth_burst)
        self.suppressed = RefusalTally(max_buckets=MAX_SOURCES)
        self._last_summary = clock()
        self._pending: list[tuple[dict[str, Any], asyncio.Future[None] | None]] = []
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one delivery at a time: the spool is replayed in order
        self.marker = spool.path.with_name(spool.path.stem + ".replayed")
        self.set_aside_file = spool.path.with_name(spool.path.stem + ".setaside.jsonl")
        self.replayed_seq = self._read_marker()
        self._spooled = asyncio.Event()  # set when events went to the spool: the replayer has work
        # counters (metrics, tests, benchmarks)
        self.requests_sent = 0  # internal requests to the guard (batches + replays)
        self.events_sent = 0
        self.events_spooled = 0
        self.events_replayed = 0
        self.events_counted = 0  # rate-limited: counted, not written one by one
        self.batches_refused = 0  # internal requests the guard refused (400/413): split
        self.events_set_aside = 0  # single spooled events the guard refused: set aside, not replayed

    # ------------------------------------------------------------------------- appending

    def append(self, event: Mapping[str, Any], *, source: str | None = None) -> asyncio.Future[None] | None:
        """Queue one event; the future resolves once it is durable (in the guard's log or the spool).

        ``source`` marks an event without a verified session (rate-limited per source): beyond the
        rate it is counted and ``None`` is returned."""
        ev = {k: v for k, v in event.items() if v is not None and k != "type"}
        now = self.clock()
        ev.setdefault("id", new_event_id(now))
        ev.setdefault("ts", now)
        if source is not None and not self._buckets.take(source, now):
            self.suppressed.add(f"{source} {ev.get('code') or ev.get('action') or '-'}", now=now)
            self.events_counted += 1
            if now - self._last_summary >= self.summary_interval:
                self._kick()
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((ev, fut))
        self._kick()
        return fut

    def _kick(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    def _summary(self, *, force: bool = False) -> dict[str, Any] | None:
        now = self.clock()
        if not force and now - self._last_summary < self.summary_interval:
            return None
        snap = self.suppressed.take()
        if snap is None:
            return None
        self.suppressed.done(snap)
        self._last_summary = now
        return {
            "id": new_event_id(now),
            "ts": now,
            "action": SUPPRESSED_ACTION,
            "allowed": False,
            "count": sum(snap["counts"].values()),
            "by": dict(snap["counts"]),
            "reason": "unauthenticated requests beyond the per-source logging rate, counted",
            "first": _iso(snap["first"]),
            "last": _iso(snap["last"]),
        }

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # one tick: whatever is refused concurrently joins this batch
        while True:
            n = fits([wire_size(ev) for ev, _ in self._pending[: contract.MAX_INTERNAL_EVENTS]])
            batch = self._pending[:n]
            del self._pending[:n]
            summary = self._summary()
            if summary is not None:
                batch.insert(0, (summary, None))
            if not batch:
                return
            await self._deliver(batch)

    async def _deliver(self, batch: list[tuple[dict[str, Any], asyncio.Future[None] | None]]) -> None:
        events = [ev for ev, _ in batch]
        error: UompError | None = None
        async with self._lock:
            try:
                if self.spool.last_seq > self.replayed_seq:
                    await self._replay_locked()
                await self._post(events)
                self.events_sent += len(events)
            except UompError as exc:
                if isinstance(exc, Refused):  # the replay splits it and sets aside what stays refused
                    self.batches_refused += 1
                    log.warning(
                        "one log: the guard refused a batch of %d event(s) (%s %s); spooled, "
                        "to be replayed in smaller batches",
                        len(events),
                        exc.http_status,
                        exc.guard_code,
                    )
                try:
                    await self._to_spool(events, exc)
                except (UompError, ValueError) as spool_exc:  # ValueError: an event the spool refuses
                    error = UompError(ErrorCode.STORE_UNAVAILABLE, str(spool_exc))
            except Exception as exc:  # never leave a request waiting on an event nobody will write
                log.error("one log: delivering %d event(s) failed (%s)", len(events), type(exc).__name__)
                error = UompError(ErrorCode.STORE_UNAVAILABLE, "the event could not be recorded")
        for _, fut in batch:
            if fut is None or fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(
                    UompError(
                        ErrorCode.STORE_UNAVAILABLE,
                        "the event could not be recorded (guard unreachable and the local spool failing)",
                    )
                )

    async def _post(self, events: list[dict[str, Any]]) -> None:
        self.requests_sent += 1
        status, body = await self.forwarder.json_call("POST", contract.INTERNAL_EVENTS_PATH, body={"events": events})
        if status != 200:
            err = body.get("error")
            code = err.get("code") if isinstance(err, dict) else None
            if status in REFUSED_STATUSES:
                raise Refused(status, str(code or "-")[:40])
            raise UompError(ErrorCode.STORE_UNAVAILABLE, f"the guard did not record the events ({code or status})")

    async def _to_spool(self, events: list[dict[str, Any]], why: UompError) -> None:
        tickets = [self.spool.append(ev) for ev in events]
        await self.spool.flush(max(tickets))
        if not self.events_spooled:
            log.warning(
                "guard unreachable for the one log (%s): events spooled in %s, replayed when it returns",
                why.code,
                self.spool.path.name,
            )
        self.events_spooled += len(events)
        self._spooled.set()

    # ------------------------------------------------------------------------- replay

    def _read_marker(self) -> int:
        try:
            return int(self.marker.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    @property
    def backlog(self) -> int:
        """Spooled events not yet in the guard's log."""
        return max(0, self.spool.last_seq - self.replayed_seq)

    async def replay(self) -> int:
        """Replay the spool into the guard's log (oldest first); the number of events replayed.
        Raises ``STORE_UNAVAILABLE`` while the guard does not take them."""
        async with self._lock:
            return await self._replay_locked()

    async def _replay_locked(self) -> int:
        done = 0
        refused, set_aside = self.batches_refused, self.events_set_aside
        try:
            while self.spool.last_seq > self.replayed_seq:
                records = await asyncio.to_thread(
                    self.spool.read, after_seq=self.replayed_seq, limit=contract.MAX_INTERNAL_EVENTS
                )
                if not records:
                    break
                items = [(r, spooled_event(r)) for r in records]
                n = fits([wire_size(ev) for _, ev in items])
                done += await self._replay_items(items[:n])
        finally:
            if done:
                log.info("replayed %d spooled event(s) into the guard's log", done)
            if self.batches_refused > refused:
                log.warning(
                    "one log: the guard refused %d replay batch(es) (400/413): split; %d event(s) set aside in %s",
                    self.batches_refused - refused,
                    self.events_set_aside - set_aside,
                    self.set_aside_file.name,
                )
        return done

    async def _replay_items(self, items: list[tuple[dict[str, Any], dict[str, Any]]]) -> int:
        """Post spooled (record, event) pairs in one request, the marker moved past them once the
        guard acknowledged; a refused batch in halves, in order; one refused event set aside. The
        number of events written."""
        try:
            if len(items) == 1 and wire_size(items[0][1]) + _BODY_OVERHEAD > contract.MAX_INTERNAL_EVENTS_BYTES:
                raise Refused(413, "PAYLOAD_TOO_LARGE")  # can never be accepted: not even sent
            await self._post([ev for _, ev in items])
        except Refused as exc:
            self.batches_refused += 1
            if len(items) == 1:
                await self._set_aside(items[0], exc)
                return 0
            mid = len(items) // 2
            return await self._replay_items(items[:mid]) + await self._replay_items(items[mid:])
        fault_point("gateway_spool_acked")  # the guard has them, the marker does not say so yet
        await self._mark(int(items[-1][0]["seq"]))
        self.events_replayed += len(items)
        return len(items)

    async def _mark(self, seq: int) -> None:
        await asyncio.to_thread(atomic_write, self.marker, f"{seq}\n".encode())
        self.replayed_seq = seq

    async def _set_aside(self, item: tuple[dict[str, Any], dict[str, Any]], why: Refused) -> None:
        """One spooled event the guard refuses on its own: recorded (durably, without its fields),
        reported in the guard's log, skipped. Idempotent: a crash before the marker moves does it again,
        the same line (same seq) and the same report event (same id)."""
        record, event = item
        seq = int(record["seq"])
        eid = event.get("id")
        eid = eid if isinstance(eid, str) and _SAFE_ID.fullmatch(eid) else None
        line = {
            "seq": seq,
            "id": eid,
            "status": why.http_status,
            "code": why.guard_code,
            "bytes": wire_size(event),
            "at": _iso(self.clock()),
        }
        await asyncio.to_thread(_append_line, self.set_aside_file, json.dumps(line, sort_keys=True))
        self.events_set_aside += 1
        log.warning(
            "one log: spooled event seq %d (id %s) refused by the guard (%s %s), set aside in %s; the replay goes on",
            seq,
            eid or "-",
            why.http_status,
            why.guard_code,
            self.set_aside_file.name,
        )
        report = {
            "id": "gw_" + hashlib.sha256(f"set-aside:{seq}:{record.get('prev')}".encode()).hexdigest()[:32],
            "ts": self.clock(),
            "action": SET_ASIDE_ACTION,
            "allowed": False,
            "code": why.guard_code,
            "status": why.http_status,
            "detail": eid,
            "count": 1,
            "reason": f"a gateway event the guard refused ({why.http_status} {why.guard_code}) is kept in the "
            f"gateway's spool at seq {seq} and listed in {self.set_aside_file.name}",
        }
        try:
            await self._post([{k: v for k, v in report.items() if v is not None}])
        except Refused as exc:  # not expected (a small well-formed event): the file line and the log say it
            log.error(
                "one log: the report of set-aside spool seq %d was refused too (%s %s)",
                seq,
                exc.http_status,
                exc.guard_code,
            )
        await self._mark(seq)

    def set_aside(self) -> list[dict[str, Any]]:
        """The set-aside list (one entry per spool seq, oldest first)."""
        try:
            text = self.set_aside_file.read_text()
        except FileNotFoundError:
            return []
        seen: dict[int, dict[str, Any]] = {}
        for raw in text.splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                entry = json.loads(raw)
                seen.setdefault(int(entry["seq"]), entry)
        return [seen[k] for k in sorted(seen)]

    async def run_replayer(
        self, interval: float = REPLAY_INTERVAL_SECONDS, backoff_max: float = REPLAY_BACKOFF_MAX_SECONDS
    ) -> None:
        """Background task: replay the spool whenever it holds events and the guard answers; while it
        does not, the wait doubles up to ``backoff_max``. An empty spool is waited on (the next
        events spooled wake it), so an idle gateway has no timer here."""
        wait = interval
        while True:
            if not self.backlog:
                wait = interval
                self._spooled.clear()
                if not self.backlog:  # nothing spooled between the look and the clear
                    await self._spooled.wait()
            await asyncio.sleep(wait)
            if not self.backlog:  # a live delivery replayed it first (it replays before posting)
                continue
            try:
                await self.replay()
                wait = interval
            except UompError:
                wait = min(backoff_max, wait * 2)

    async def close(self) -> None:
        """Deliver what is queued (and a pending summary) before the gateway stops."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        summary = self._summary(force=True)
        if summary is not None:
            with contextlib.suppress(Exception):
                await self._deliver([(summary, None)])


def spooled_event(record: Mapping[str, Any]) -> dict[str, Any]:
    """A spool line as an event for the guard: the spool's own fields dropped; a spool summary
    (written by the access log itself when it could not write) gets an id derived from its chain
    link, so replaying it twice is one event too."""
    ev = {k: v for k, v in record.items() if k not in SPOOL_FIELDS}
    kind = record.get("type")
    if "id" not in ev:
        ev["id"] = "gw_" + hashlib.sha256(f"{record.get('seq')}:{record.get('prev')}".encode()).hexdigest()[:32]
    if "ts" not in ev:
        ev["ts"] = _parse_iso(str(record.get("timestamp", "")))
    if kind in (GAP_TYPE, SUPPRESSED_TYPE):
        ev["action"] = f"gateway_{kind}"
        by = ev.pop("by_action", None) or ev.pop("by_source_code", None)
        if isinstance(by, dict):
            ev["by"] = by
    return ev


def _append_line(path: Path, line: str) -> None:
    """Append one line and fsync it (the file is created 0600, its directory synced)."""
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(path.parent)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"


def _parse_iso(s: str) -> float:
    try:
        return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


def spool_path(gateway_dir: Path) -> Path:
    """The gateway's durable spool of events the guard has not acknowledged."""
    return gateway_dir / "access.jsonl"


__all__ = ["EventSink", "Refused", "fits", "new_event_id", "spool_path", "spooled_event", "wire_size"]
