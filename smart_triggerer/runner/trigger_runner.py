"""The async trigger runner subprocess: Airflow's own, with twelve changes (cancels without ``on_kill``
on a handover, waking on events, ends reported by each coroutine, fewer log lines, uvloop, a batched log
channel, the collector at a big start, cheaper creation, asking ahead, no greenback portal where none is
needed, cheaper JWT redaction, nudges). Each is named where it is made; why, and what it was measured to
save: docs/design.md, "The trigger runner: what differs from Airflow's"."""

from __future__ import annotations

import asyncio
import contextvars
import math
import os
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any

import anyio
import structlog
from airflow.jobs.triggerer_job_runner import _USER_ACTION_CANCEL_MSG, TriggerRunner, log

# the names Airflow's create loop uses, from its own module: our copy of the loop follows its choices
from airflow.jobs.triggerer_job_runner import (  # type: ignore[attr-defined]  # isort: skip
    Asset,
    AssetStateStoreAccessors,
    BaseEventTrigger,
)
from airflow.triggers.base import TriggerEvent

from smart_triggerer.config import Settings
from smart_triggerer.runner.collector import StartFreezer, collect_young_while_idle, tune_collector
from smart_triggerer.runner.kwargs import decode_kwargs, decrypt_kwargs
from smart_triggerer.runner.loop_lag import BlockSpotter, LagBoard, LagMeter
from triggers.identity import IDENTITY_KWARG

# made in the supervisor before Airflow forks the runner: the runner writes its event-loop lag here
LAG_BOARD = LagBoard()

HANDOVER_CANCEL_MSG = "smart-triggerer handover"
IDLE_TICK = 0.5
BUSY_TICK = 0.02  # while the supervisor hands over coroutines to start (a takeover, a start), ask again soon
EVENT_GATHER = 0.1
FINAL_SYNC_SECONDS = 1.0  # a stopped runner's last sync of its events (the supervisor may be gone)
COMPLETED_LINE = "trigger completed"  # Airflow's last line of every coroutine (``run_trigger``)
FIRED_LINE = "Trigger fired event"  # Airflow's line for each event a coroutine yields
LOG_CHANNEL_BYTES = 4 * 2**20  # thousands of log lines in flight before the runner waits for the supervisor
LOG_BATCH_BYTES = 256 * 2**10  # log lines sent at once at most (sooner when the loop pass ends)
CREATE_YIELD_EVERY = 64  # coroutines created between two yields to the event loop (a few milliseconds)
PREFETCH_BELOW = 1000  # during a handover, the next pile is asked for with this many left (about 0.3 s)
# the supervisor's nudge (design: Nudges): its default action is to be ignored, so a nudge sent before
# the runner listens (or to a runner of another build) does nothing
NUDGE_SIGNAL = signal.SIGURG
# Airflow's JWT_PATTERN as this release knows it (design: JWT redaction): every match starts with JWT_PREFIX
JWT_PATTERN = re.compile(r"eyJ[\.A-Za-z0-9-_]*")
JWT_PREFIX = "eyJ"
# set around the creation of a coroutine whose trigger makes no sync SDK call (design: Greenback's portal):
# copied into its task
_WITHOUT_PORTAL: contextvars.ContextVar[bool] = contextvars.ContextVar("without_portal", default=False)


def widen_log_channel(wanted: int = LOG_CHANNEL_BYTES) -> int | None:
    """Give the socket the runner's log lines go through (the ``io`` of Airflow's structlog logger
    factory) a send buffer of ``wanted`` bytes; returns the size it has, None when there is no socket."""
    factory = structlog.get_config().get("logger_factory")
    io = getattr(factory, "io", None)
    try:
        fileno = io.fileno() if io is not None else None
    except (OSError, ValueError):
        fileno = None
    if fileno is None:
        return None
    try:
        channel = socket.socket(fileno=os.dup(fileno))
    except OSError:
        return None  # not a socket (a file, a pipe): nothing to widen
    with channel:  # closes the duplicate only; the option belongs to the socket both share
        channel.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, wanted)
        return int(channel.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


def skip_untraced_spans() -> bool:
    """With tracing off, give Airflow's ``run_trigger`` one shared non-recording span; True if it did.

    Airflow opens an OpenTelemetry span for every coroutine it starts, also when no tracer provider is set
    (``[traces] otel_on`` false): extracting the task's trace context and attaching a no-op span for each
    new coroutine of a takeover costs the runner CPU for nothing (docs/design.md, Measurements behind the
    code). With a provider set, nothing changes.
    """
    from airflow.configuration import conf
    from airflow.jobs import triggerer_job_runner
    from opentelemetry import trace

    if conf.getboolean("traces", "otel_on", fallback=False):
        return False
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return False  # a provider set some other way (auto-instrumentation): keep Airflow's spans

    def untraced(**_: Any) -> AbstractContextManager[trace.Span]:
        return nullcontext(trace.INVALID_SPAN)

    triggerer_job_runner._make_trigger_span = untraced  # type: ignore[assignment]
    return True


class _PortalOnDemand:
    """Stands in for the ``greenback`` module in Airflow's runner module: ``ensure_portal`` does nothing in
    a task created without a portal (design: Greenback's portal); everything else is greenback's (the
    module Airflow imported:
    greenback is Airflow's dependency, not ours)."""

    def __init__(self, greenback: Any) -> None:
        self._greenback = greenback

    async def ensure_portal(self, *args: Any, **kwargs: Any) -> None:
        if not _WITHOUT_PORTAL.get():
            await self._greenback.ensure_portal(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._greenback, name)


def portal_on_demand() -> None:
    """Airflow's ``run_trigger`` gives a portal only to coroutines that may need one (design: Greenback's
    portal)."""
    from airflow.jobs import triggerer_job_runner

    module: Any = triggerer_job_runner
    if not isinstance(module.greenback, _PortalOnDemand):
        module.greenback = _PortalOnDemand(module.greenback)


def needs_portal(trigger_class: Any, context: Any) -> bool:
    """A coroutine of ``trigger_class`` may call a sync SDK method: it says nothing (every trigger written
    for Airflow), or it renders templates. Only the class's own word counts: a subclass (of ours, say)
    may add a sync call, so it must say ``calls_sync_sdk = False`` again."""
    return context is not None or vars(trigger_class).get("calls_sync_sdk", True) is not False


def listen_for_nudges(wake: Callable[[], None]) -> bool:
    """``NUDGE_SIGNAL`` ends the runner's idle tick (design: Nudges); False where the loop cannot handle
    signals
    (not the main thread)."""
    try:
        asyncio.get_running_loop().add_signal_handler(NUDGE_SIGNAL, wake)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def quick_jwt_redaction() -> int:
    """Airflow's ``redact_jwt`` log processor in the configured chain replaced by ``redact_jwt_quickly``
    (design: JWT redaction), in place: loggers made before share the list; returns how many were replaced."""
    from airflow.sdk._shared.logging import structlog as airflow_structlog

    theirs = airflow_structlog.JWT_PATTERN
    if (theirs.pattern, theirs.flags) != (JWT_PATTERN.pattern, JWT_PATTERN.flags):
        return 0  # another Airflow's pattern or flags (IGNORECASE would match "EYJ"): its processor stays
    processors = structlog.get_config().get("processors") or []
    replaced = 0
    for index, processor in enumerate(processors):
        if processor is airflow_structlog.redact_jwt:
            processors[index] = redact_jwt_quickly
            replaced += 1
    return replaced


def redact_jwt_quickly(logger: Any, method_name: str, event_dict: Any) -> Any:
    """Airflow's ``redact_jwt``, which gives a plain string back unchanged unless its pattern matches, and
    its pattern starts with the literal ``eyJ``: a plain string without it is passed over, not searched.
    Airflow's ran ``re.sub`` (a cache lookup, then the search) over every string of every line, a good
    part of the cost of a coroutine's "trigger ... starting" line (docs/design.md, Measurements behind the
    code). A ``str`` subclass still goes through the substitution, which gives it back as a plain ``str``
    (rendered differently from the subclass). It is installed only while Airflow's pattern is
    ``JWT_PATTERN``."""
    for key, value in event_dict.items():
        if isinstance(value, str) and (type(value) is not str or JWT_PREFIX in value):
            event_dict[key] = JWT_PATTERN.sub("eyJ***", value)
    return event_dict


class BatchedLogChannel:
    """The runner's log channel, its lines gathered and sent in one write per ``drain`` (or per
    ``LOG_BATCH_BYTES``) rather than one each. Whole lines only: structlog writes a line per ``write``. A
    lock keeps lines that threads (sync triggers) write while a batch goes out.

    The lock is reentrant: a line can be logged on the very thread that is inside ``drain`` (a garbage
    collector's finalizer, a signal handler); with a plain lock that thread waited on itself for ever, and
    the runner's event loop with it. Such a line is only added to the next batch: a nested drain would
    write it into the middle of a line the outer one has only partly written."""

    def __init__(self, raw: Any, limit: int = LOG_BATCH_BYTES) -> None:
        self.raw = raw
        self.limit = limit
        self._pending = bytearray()
        self._lock = threading.RLock()
        self._draining = False

    def write(self, data: bytes) -> int:
        with self._lock:
            self._pending += data
            full = len(self._pending) >= self.limit and not self._draining
        if full:
            self.drain()
        return len(data)

    def flush(self) -> None:
        """structlog flushes after every line: the batch goes at the loop's ``drain`` instead."""

    def drain(self) -> None:
        with self._lock:
            if self._draining:
                return  # called again on the draining thread: the outer drain sends what is pending
            self._draining = True
            try:
                while self._pending:  # lines added while a batch went out go in the next one
                    batch, self._pending = memoryview(bytes(self._pending)), bytearray()
                    while batch:  # a blocking write of a socket may take part of it
                        batch = batch[self.raw.write(batch) :]
            finally:
                self._draining = False

    def close(self) -> None:
        self.drain()
        self.raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def batch_log_channel() -> BatchedLogChannel | None:
    """Loggers made from now on write the runner's log channel through a ``BatchedLogChannel``."""
    factory = structlog.get_config().get("logger_factory")
    io = getattr(factory, "io", None)
    if io is None or isinstance(io, BatchedLogChannel):
        return io
    factory.io = BatchedLogChannel(io)  # type: ignore[union-attr]
    return factory.io  # type: ignore[union-attr,no-any-return]


def prepare_runner_process() -> BatchedLogChannel | None:
    """What the runner process changes in Airflow's set-up before it runs (items 6, 7, 10, 11, and the
    untraced spans), once logging is configured; returns its batched log channel. The runner bench makes
    its process the same way."""
    tune_collector()  # what the fork brought is not garbage; thousands of coroutines need no scans
    widen_log_channel()
    channel = batch_log_channel()
    skip_untraced_spans()
    portal_on_demand()
    quick_jwt_redaction()
    return channel


class _TriggerLog:
    """Airflow's trigger runner logger, minus "trigger completed" for a coroutine that fired.

    ``run_trigger`` binds the coroutine's ``trigger_id`` to the logging context of its asyncio task, so
    the line can be matched to the coroutine's event count. Everything else passes through unchanged.
    """

    def __init__(self, log: Any, triggers: dict[int, Any], send_now: Callable[[], None]) -> None:
        self._log = log
        self._triggers = triggers
        self._send_now = send_now

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    async def ainfo(self, event: str, *args: Any, **kw: Any) -> Any:
        if event == COMPLETED_LINE and self._fired():
            return None
        # on the loop's own thread: structlog's ``ainfo`` hands each line to a thread pool so that a slow
        # write never blocks the loop, but the runner's channel only adds it to a batch (design: The log
        # channel). Through the pool, each of the last lines of a handover's thousands of cancelled
        # coroutines also pays a hand-over to a thread (measured: docs/design.md).
        result = self._log.info(event, *args, **kw)
        if event == FIRED_LINE:
            # sent at once, as Airflow's own line is: an instance killed before its next sync leaves the
            # line of what it fired in its log (the event itself is redone by the next owner)
            self._send_now()
        return result

    def _fired(self) -> bool:
        """The calling coroutine sent an event and is ending without being cancelled."""
        details = self._triggers.get(structlog.contextvars.get_contextvars().get("trigger_id", 0))
        task = asyncio.current_task()
        return (
            details is not None
            and details["events"] > 0
            and task is details["task"]
            and not task.cancelling()
        )


class _WakingDeque(deque[Any]):
    """A deque that calls ``on_append`` after every append (events fired by trigger coroutines)."""

    def __init__(self, on_append: Callable[[], None]) -> None:
        super().__init__()
        self.on_append = on_append

    def append(self, item: Any) -> None:
        super().append(item)
        self.on_append()


class _WatchedTriggers(dict[int, Any]):
    """Airflow's ``triggers`` dict: each coroutine put in it reports its end to ``on_end``."""

    def __init__(self, on_end: Callable[[int], None]) -> None:
        super().__init__()
        self.on_end = on_end

    def __setitem__(self, trigger_id: int, details: Any) -> None:
        super().__setitem__(trigger_id, details)
        details["task"].add_done_callback(lambda _task: self.on_end(trigger_id))


class SmartTriggerRunner(TriggerRunner):
    def __init__(self) -> None:
        super().__init__()
        self._wake: asyncio.Event | None = None
        self._last_sync = -math.inf
        self._handing_over = False
        self._prefetch: asyncio.Task[None] | None = None  # a sync asking for the next pile, while creating
        self._asked = False  # a question asked ahead was answered since the loop last synced
        self._taken = 0  # coroutines taken from ``to_create`` so far: tells what a sync brought
        self.events = _WakingDeque(self._on_event)
        self._ended: deque[int] = deque()
        self.triggers = _WatchedTriggers(self._ended.append)
        # the ignore is needed where Airflow's runner annotates ``log`` otherwise (releases differ)
        self.log = _TriggerLog(self.log, self.triggers, self._send_log_lines)  # type: ignore[assignment, unused-ignore]
        self.log_channel: BatchedLogChannel | None = None
        self.lag_meter = LagMeter(LAG_BOARD)
        self.freezer = StartFreezer()

    async def create_triggers(self) -> None:
        """Every coroutine to create, a pile at a time (piles asked ahead arrive meanwhile): each pile is
        frozen at its end when the start is big (collector.py)."""
        while self.to_create and not self.stop:
            coming = len(self.to_create)
            with self.freezer.start(coming):
                await self._create_some(coming)
            # each pile's first steps are not load (a takeover's piles may all come in this one call)
            self.lag_meter.started(coming)

    async def _create_some(self, count: int) -> None:
        """Airflow's ``TriggerRunner.create_triggers`` (3.3) for the next ``count`` workloads, yielding
        once per ``CREATE_YIELD_EVERY`` (and asking ahead for the next pile)."""
        for created in range(count):
            if created % CREATE_YIELD_EVERY == 0:
                self._ask_ahead()
                await asyncio.sleep(0)
            workload = self.to_create.popleft()
            self._taken += 1
            imported = workload.classpath not in self.trigger_cache
            self._create_one(workload)
            if imported:  # loading the trigger's code could have been expensive: others run first
                await asyncio.sleep(0)

    def _ask_ahead(self) -> None:
        """While piles come, ask for the next one before this one is done (one question at a time, as
        often as answers come while a pile lasts)."""
        if self._prefetch is not None and self._prefetch.done():
            self._collect_answer()
        if (
            self._handing_over
            and self._prefetch is None
            and not self.stop
            and len(self.to_create) <= PREFETCH_BELOW
        ):
            self._prefetch = asyncio.create_task(self._sync_ahead(), name="ask ahead")

    async def _sync_ahead(self) -> None:
        await self.sync_state_to_supervisor(await self.cleanup_finished_triggers())

    def _collect_answer(self) -> None:
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None:
            prefetch.result()  # a failed question fails the loop, as a failed sync does
            self._asked = True
            self._cancel_running()

    def _cancel_running(self) -> None:
        """Cancels an answer brought while a pile is created: running coroutines' now (a handover must not
        wait for the whole takeover to be created), the others' after the pile, as usual."""
        # once each: every answer brings the supervisor's whole set of cancels again
        later = [signed_id for signed_id in dict.fromkeys(self.to_cancel) if not self._cancel_one(signed_id)]
        self.to_cancel.clear()
        self.to_cancel.extend(later)

    def _cancel_one(self, signed_id: int) -> bool:
        """Cancel a running coroutine (negative id: a handover, without ``on_kill``); False if not running."""
        details = self.triggers.get(abs(signed_id))
        if details is None:
            return False
        details["task"].cancel(HANDOVER_CANCEL_MSG if signed_id < 0 else _USER_ACTION_CANCEL_MSG)
        return True

    async def _asked_ahead(self) -> bool:
        """Wait for a question asked ahead, if one is out; True if any was answered since the last look."""
        if self._prefetch is not None:
            await asyncio.wait([self._prefetch])
            self._collect_answer()
        asked, self._asked = self._asked, False
        return asked

    def _sync_needed(self, asked: bool) -> bool:
        """The loop's sync is left out only when a question asked ahead brought coroutines still to create
        and nothing happened since that the supervisor must hear (an event, a failure, an end)."""
        if not asked or not self.to_create:
            return True
        return bool(self.events or self.failed_triggers or self._ended)

    def _create_one(self, workload: Any) -> None:
        """One coroutine, as Airflow's loop creates it (the same log lines and failures)."""
        trigger_id = workload.id
        if trigger_id in self.triggers:
            self.log.warning("Trigger %s had insertion attempted twice", trigger_id)
            return
        try:
            # Any: Airflow sets attributes BaseTrigger does not declare (triggerer_job_id, timeout_after)
            trigger_class: Any = self.get_trigger_by_classpath(workload.classpath)
        except BaseException as e:
            # Either the trigger code or the path to it is bad. Fail the trigger.
            self.log.error("Trigger failed to load code", error=e, classpath=workload.classpath)
            self.failed_triggers.append((trigger_id, e))
            return
        context = None
        try:
            # only serialization artifacts are cleaned here, as in Airflow (not in decrypt_kwargs)
            kw = decrypt_kwargs(workload.encrypted_kwargs)  # Airflow's, the identity marker left as it is
            # Airflow's decoding, where it changes anything (our identity marker: plain JSON)
            deserialised_kwargs = decode_kwargs(kw, as_is=IDENTITY_KWARG)
            if ti := workload.ti:
                trigger_name = (
                    f"{ti.dag_id}/{ti.run_id}/{ti.task_id}/{ti.map_index}/{ti.try_number} (ID {trigger_id})"
                )
                trigger_instance = trigger_class(**deserialised_kwargs)
                if workload.dag_data:
                    runtime_ti = self.create_runtime_ti(ti, workload.dag_data, workload.dag_run_data)
                    context = runtime_ti.get_template_context()
                    trigger_instance.task_instance = runtime_ti
                else:
                    trigger_instance.task_instance = ti
            else:
                trigger_name = f"ID {trigger_id}"
                trigger_instance = trigger_class(**deserialised_kwargs)
        except TypeError as err:
            self.log.error("Trigger failed to inflate", error=err)
            self.failed_triggers.append((trigger_id, err))
            return
        trigger_instance.trigger_id = trigger_id
        trigger_instance.triggerer_job_id = self.job_id
        trigger_instance.timeout_after = workload.timeout_after
        if isinstance(trigger_instance, BaseEventTrigger) and workload.watched_assets:
            trigger_instance.asset_state_store = AssetStateStoreAccessors(
                inlets=[Asset(name=name, uri=uri) for name, uri in workload.watched_assets.items()]
            )
        portal = _WITHOUT_PORTAL.set(not needs_portal(trigger_class, context))
        try:  # the task takes a copy of this context
            task = asyncio.create_task(
                self.run_trigger(trigger_id, trigger_instance, workload.timeout_after, context),
                name=trigger_name,
            )
        finally:
            _WITHOUT_PORTAL.reset(portal)
        self.triggers[trigger_id] = {
            "task": task,
            "is_watcher": isinstance(trigger_instance, BaseEventTrigger),
            "name": trigger_name,
            "events": 0,
        }

    def _on_event(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def cancel_triggers(self) -> None:
        while self.to_cancel:
            self._cancel_one(self.to_cancel.popleft())
            await asyncio.sleep(0)

    async def cleanup_finished_triggers(self) -> list[int]:
        """Airflow's, over the coroutines that ended since the last tick only."""
        finished_ids: list[int] = []
        while self._ended:
            trigger_id = self._ended.popleft()
            details = self.triggers.get(trigger_id)
            if details is None or not details["task"].done():
                continue
            finished_ids.append(trigger_id)
            self._report_end(trigger_id, details)
            del self.triggers[trigger_id]
        return finished_ids

    def _report_end(self, trigger_id: int, details: Any) -> None:
        """As Airflow: log an error exit; a coroutine that ended without an event fails its tasks."""
        saved_exc = None
        try:
            result = details["task"].result()
        except (asyncio.CancelledError, SystemExit, KeyboardInterrupt):
            return  # expected: a cancel (a task's user action, a handover) or shutdown
        except BaseException as e:
            self.log.exception("Trigger %s exited with error %s", details["name"], e, trigger_id=trigger_id)
            saved_exc = e
        else:
            if isinstance(result, TriggerEvent):
                self.log.error(
                    "Trigger returned a TriggerEvent rather than yielding it",
                    trigger=details["name"],
                    trigger_id=trigger_id,
                )
        if details["events"] == 0:
            self.log.error(
                "Trigger exited without sending an event. Dependent tasks will be failed.",
                name=details["name"],
                trigger_id=trigger_id,
            )
            self.failed_triggers.append((trigger_id, saved_exc))

    def run(self) -> None:
        """Airflow's entry point, on the ``[smart_triggerer] event_loop`` (validated by the supervisor)."""
        self.log_channel = prepare_runner_process()
        if Settings.from_airflow().event_loop == "uvloop":
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        try:
            super().run()
        finally:
            self._send_log_lines()

    def _send_log_lines(self) -> None:
        if self.log_channel is not None:
            with suppress(OSError):  # the supervisor is gone: nobody is left to read them
                self.log_channel.drain()

    def _handle_signal(self, signum: int, frame: Any) -> None:
        super()._handle_signal(signum, frame)
        self._on_event()  # a waiting tick ends at once

    async def _tick(self) -> None:
        """Sleep up to ``IDLE_TICK``; wake early on stop or on a fired event, but while events keep coming,
        no sooner than ``EVENT_GATHER`` after the last sync (one sync carries the events of that time)."""
        assert self._wake is not None
        if not self.events:
            if not self._handing_over and not self.to_create:
                collect_young_while_idle()  # not within the next start's first piles (collector.py)
            with suppress(TimeoutError):
                async with asyncio.timeout(BUSY_TICK if self._handing_over else IDLE_TICK):
                    await self._wake.wait()
        self._wake.clear()
        if self.events and not self.stop:
            rest = self._last_sync + EVENT_GATHER - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)

    async def sync_state_to_supervisor(self, finished_ids: list[int]) -> None:
        # lines first: the supervisor closes an ended coroutine's log file when the sync says it ended
        self._send_log_lines()
        self._last_sync = time.monotonic()
        before = len(self.to_create) + self._taken  # the create loop may take some while the answer comes
        await super().sync_state_to_supervisor(finished_ids)
        # the supervisor builds coroutines in batches: one came, more may be ready by the next tick
        self._handing_over = len(self.to_create) + self._taken > before

    async def arun(self) -> None:
        """Airflow's ``TriggerRunner.arun`` (3.3), with ``_tick`` in place of its fixed one-second sleep."""
        await self.init_comms()
        self.log.info("trigger runner started", event_loop=type(asyncio.get_running_loop()).__module__)
        self._wake = asyncio.Event()
        nudged = listen_for_nudges(self._on_event)
        watchdog = asyncio.create_task(self.block_watchdog())
        lag_meter = asyncio.create_task(self.lag_meter.run())
        BlockSpotter(asyncio.get_running_loop(), self.lag_meter).start()
        self._stop_event = anyio.Event()
        last_status = time.monotonic()
        try:
            while not self.stop:
                if watchdog.done():
                    watchdog.result()
                reader = self.comms_decoder._reader_task
                if reader is not None and reader.done():
                    reader.result()
                    raise RuntimeError("Supervisor connection lost")
                # a question asked ahead brought this pass's pile: no second sync unless there is news.
                # (The reader's check above comes first: a question out to a dead reader would never end.)
                if self._sync_needed(await self._asked_ahead()):
                    await self.sync_state_to_supervisor(await self.cleanup_finished_triggers())
                await self.create_triggers()
                await self.cancel_triggers()
                self._send_log_lines()  # this pass's lines, in one write, before the loop sleeps
                await self._tick()
                if (now := time.monotonic()) - last_status >= 60:
                    watchers = len([t for t in self.triggers.values() if t["is_watcher"]])
                    self.log.info("%i triggers currently running", len(self.triggers) - watchers)
                    self.log.info("%i watchers currently running", watchers)
                    last_status = now
            await self._final_sync()
        except Exception:
            with suppress(BrokenPipeError):
                await log.aexception("Trigger runner failed")
            self.stop = True
            raise
        finally:
            if nudged:
                asyncio.get_running_loop().remove_signal_handler(NUDGE_SIGNAL)
            lag_meter.cancel()
            await self._end_run()
        await watchdog

    async def _final_sync(self) -> None:
        """Stopped by a signal (a whole process group's SIGTERM reaches the runner too): the events fired
        since the last sync go to the supervisor before the runner exits, which stores them under its
        leases; an event of a source that hands it out once would be lost with the process. Bounded: the
        supervisor may be gone."""
        reader = self.comms_decoder._reader_task
        if reader is None or reader.done():
            return
        with suppress(Exception):
            async with asyncio.timeout(FINAL_SYNC_SECONDS):
                await self._sync_events()  # what fired before the stop goes first, whatever comes next
                await self._end_coroutines(FINAL_SYNC_SECONDS / 2)
                await self._sync_events()  # and what fired while they ended

    async def _sync_events(self) -> None:
        if self.events:
            await self._asked_ahead()
            await self.sync_state_to_supervisor(await self.cleanup_finished_triggers())

    async def _end_coroutines(self, timeout: float) -> None:
        """Every coroutine ended before the last sync, not after it: one that fires while the loop is torn
        down (a message it took a moment ago) would have its event die with the process. Cancelled as in a
        handover (no ``on_kill``): the task is not over, its next owner runs it again. A coroutine slow to
        end (its cleanup waits on a stalled server) costs at most ``timeout``, never the events synced
        after it."""
        tasks = [details["task"] for details in self.triggers.values() if not details["task"].done()]
        for task in tasks:
            task.cancel(HANDOVER_CANCEL_MSG)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def _end_run(self) -> None:
        """Airflow's end of ``arun``, and the question asked ahead left unanswered."""
        if self._prefetch is not None:
            if self._prefetch.done() and not self._prefetch.cancelled():
                self._prefetch.exception()  # retrieved: the loop is ending for its own reason
            self._prefetch.cancel()
        if (reader_task := self.comms_decoder._reader_task) is not None:
            reader_task.cancel()
            with suppress(asyncio.CancelledError):
                await reader_task
        await self._shared_streams.stop_all()
