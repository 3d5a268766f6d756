"""The ``controllerd run`` process: one task group, signals, the view, election, shutdown.

Workers (all named, all owned by one task group):

* ``signals``: SIGTERM/SIGINT start the shutdown.
* ``reloader``: SIGHUP reloads the config. A SIGHUP that came during start-up,
  after the config was read but before this worker listened, reloads once it
  listens (``early_hangups``); one during the shutdown is ignored, and so is any
  later one (never the default action, which would end the process at once).
  The handlers only record the signal; the work happens here, on the loop.
* ``ops``: /metrics /healthz /readyz /status.
* ``health``: probes etcd every second; readiness and ``STATUS=`` follow it.
* ``loop-monitor``: measures how long the event loop stalls; its block watch
  thread logs where the loop is while a stall lasts.
* ``follower``: loads and follows etcd into the view, leader or not (hot standby).
* ``controller``: acts on the topics of the scopes we lead.
* ``elector``: once the view is loaded (or, while it loads, once the leader
  key has stayed vacant for :data:`LOADING_GRACE`), campaigns; grants the
  controller the scope while the lease holds and revokes it the moment it
  does not.

Exit statuses (``controllerd.errors``): 0 after SIGTERM/SIGINT; 2 when the
configuration cannot work (e.g. the ops port is taken); 3 when etcd refuses our
credentials; 70 when a worker ends or fails unexpectedly (a bug). An etcd or
broker outage of any length never ends the process. Every exit is logged.

Shutdown: stop acting (revoke, cancel), resign the lease (shielded, bounded),
close clients, exit; all within :data:`SHUTDOWN_DEADLINE`, shorter than
systemd's ``TimeoutStopSec`` and the Kubernetes grace period.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import FrameType
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import structlog

from controllerd import config as config_mod
from controllerd.adapters import backoff, sdnotify
from controllerd.adapters.audit import AuditSink, open_audit
from controllerd.adapters.broker import BrokerClient, as_profile
from controllerd.adapters.election import (
    Leadership,
    current_leader,
    identity_name,
    lead,
    wait_for_turn,
)
from controllerd.adapters.membership import ShardMembership
from controllerd.adapters.secrets import config_file_errors, read_secret
from controllerd.adapters.store import Store, StoreError, StoreUnavailable, open_store
from controllerd.core.view import Keys, MetadataView
from controllerd.daemon.blockwatch import BlockWatch
from controllerd.daemon.clock import Clock, SystemClock
from controllerd.daemon.controller import Controller, DecisionRecord
from controllerd.daemon.follower import Follower, feeding
from controllerd.daemon.logs import configure_logging
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.ops import make_ops_app, serve_ops
from controllerd.errors import EXIT_OK, EXIT_SOFTWARE, EXIT_UNAVAILABLE, OperatorError

log = structlog.get_logger("controllerd.daemon.runtime")

_T = TypeVar("_T")

#: Seconds from SIGTERM to exit, at most. systemd's TimeoutStopSec (20 s) and the
#: Kubernetes grace period (30 s) are longer.
SHUTDOWN_DEADLINE: Final = 10.0
#: Seconds between etcd probes; readiness follows them.
PROBE_INTERVAL: Final = 1.0
#: Seconds between the loop monitor's wake-ups; a later wake-up is a stall.
LOOP_TICK: Final = 0.05
#: Seconds the leader key must stay vacant before a replica still loading campaigns
#: (a warm standby takes a vacancy in milliseconds; see ``election.wait_for_turn``).
LOADING_GRACE: Final = 2.0
#: Seconds between a loading replica's looks at the leader key.
LOADING_POLL: Final = 0.5
#: Seconds between warnings while the metadata prefix holds no topic.
EMPTY_PREFIX_WARNING: Final = 600.0
#: Seconds between looks at the other election mode's keys while they hold us back.
MODE_MIX_POLL: Final = 1.0


def _no_hangups() -> int:
    """No SIGHUP came before the daemon listened (the default of ``early_hangups``)."""
    return 0


def open_configured_store(etcd: config_mod.EtcdSettings) -> AbstractAsyncContextManager[Store]:
    """The etcd client as ``[etcd]`` describes it (credentials read from their files)."""
    return open_store(
        etcd.endpoints,
        username=etcd.username,
        password=read_secret(etcd.password_file, "etcd.password_file"),
        ca_file=etcd.ca_file,
        cert_file=etcd.cert_file,
        key_file=etcd.key_file,
        timeout=etcd.timeout_seconds,
    )


class Daemon:
    """One replica. ``config`` is replaced on a valid SIGHUP; readers always see a whole one."""

    def __init__(
        self,
        config_path: str,
        env: Mapping[str, str],
        *,
        clock: Clock | None = None,
        replica: str | None = None,
        metrics: Metrics | None = None,
        early_hangups: Callable[[], int] | None = None,
    ) -> None:
        """Read the config at ``config_path`` (``env`` holds the overrides).

        ``early_hangups``, if given, counts the SIGHUPs received since the process
        started, until ``run``'s reloader listens (``controllerd run`` catches them
        that early: SIGHUP's default action ends a process). Those that came before
        the file is read here ask for nothing more than this read; any later one
        makes the reloader reload as soon as it listens.
        """
        self.config_path = config_path
        self.env = dict(env)
        self._early_hangups = early_hangups or _no_hangups
        self._hangups_before_load = self._early_hangups()  # before the read: never after it
        self.config = config_mod.load_file(config_path, self.env)
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        self.keys = Keys(self.config.metadata_prefix, self.config.controller_root)
        self.history: collections.deque[DecisionRecord] = collections.deque(maxlen=100)
        self.shutdown = anyio.Event()
        self.ops_port: int | None = None
        self.exit_code = EXIT_OK
        self._controller: Controller | None = None
        self._follower: Follower | None = None
        self._leader: tuple[Mapping[str, Any], int] | None = None
        self._broker: BrokerClient | None = None
        self._etcd_error: str | None = "not contacted yet"
        self._campaigning = False
        self._broker_auth_error: str | None = None
        self._mode_mix: str | None = None  # a replica of the other election mode, described
        self._reported: tuple[bool, str] | None = None
        self._announced_ready = False  # READY=1 sent: systemd considers us started
        self._membership: ShardMembership | None = None
        self._max_stall = 0.0
        self._max_stall_on_cpu = 0.0

    # -- config --------------------------------------------------------------------------

    def reload(self) -> bool:
        """Parse and validate the file again; on any error keep the old config.

        Only the reloadable settings take effect: restart-only ones keep their old
        values (:func:`config.reloaded`), as the code reading them later assumes.
        systemd hears ``RELOADING=1`` ... ``READY=1`` only once it was told we are
        ready: before that, ``READY=1`` would end the start-up before etcd answered.
        """
        announce = self._announced_ready
        if announce:
            sdnotify.reloading()
        try:
            new = config_mod.load_file(self.config_path, self.env)
            # As at start: a file the config names that cannot serve is a reason to refuse,
            # even a restart-only one (else the next restart would be the first to say so).
            problems = config_file_errors(new)
            if problems:
                raise config_mod.ConfigError([f"{self.config_path}: {p}" for p in problems])
            token = read_secret(new.broker.token_file, "broker.token_file", header=True)
        except Exception as exc:  # a reload never takes the daemon down, whatever the file
            if isinstance(exc, config_mod.ConfigError):
                errors = exc.errors
            elif isinstance(exc, OperatorError):
                errors = [exc.line()]
            else:  # a file we could not judge is refused too: the previous config stays
                errors = [f"{self.config_path}: {type(exc).__name__}: {exc}"]
            self.metrics.config_reloads.labels(outcome="invalid").inc()
            self.metrics.config_last_reload_ok.set(0)
            self.metrics.operator_errors.labels(kind="config-reload").inc()
            log.error(
                "config.reload.rejected", path=self.config_path, errors=errors, kept="previous"
            )
            if announce:
                sdnotify.ready()
            return False
        restart = config_mod.restart_required(self.config, new)
        self.config = config_mod.reloaded(self.config, new)
        if self._controller is not None:
            self._controller.reconfigured()  # a lowered tick interval applies now
        if self._broker is not None and self._broker.set_token(token):
            # A new token deserves a new try; the same one is still refused (readiness
            # would otherwise say ready after any reload until the next refusal).
            self._broker_auth_error = None
        configure_logging(self.config.logging.level, self.config.logging.format)
        self.metrics.config_reloads.labels(outcome="ok").inc()
        self.metrics.config_last_reload_ok.set(1)
        log.info("config.reloaded", path=self.config_path, restart_required=restart or None)
        if restart:
            log.warning(
                "config.restart_required",
                settings=restart,
                note="these settings keep their old values until a restart",
            )
        if announce:
            sdnotify.ready()
        return True

    def current_config(self) -> config_mod.Config:
        return self.config

    # -- readiness and status -----------------------------------------------------------------

    def not_ready_reason(self) -> str | None:
        """Why /readyz answers 503, or None when ready.

        Ready means: etcd answered our last probe, the view is loaded, and this
        replica is campaigning (a warm standby) or leading; a leader whose
        broker refuses its token is not ready either.
        """
        if self.shutdown.is_set():
            return "stopping"
        if self._etcd_error is not None:
            return f"etcd unreachable: {self._etcd_error}"
        follower = self._follower
        if follower is None or not follower.synced.is_set():
            loaded = follower.stats.keys_loaded if follower is not None else 0
            return f"loading metadata from etcd ({loaded} keys so far)"
        if not self._campaigning:
            return "not campaigning yet"
        if self._mode_mix is not None:
            return f"election modes mixed: {self._mode_mix}"
        if self._broker_auth_error is not None and self._leads():
            return f"the broker refuses our token: {self._broker_auth_error}"
        return None

    def ready(self) -> bool:
        return self.not_ready_reason() is None

    def _leads(self) -> bool:
        controller = self._controller
        return controller is not None and any(
            leadership.is_leader() for leadership in controller.scopes.values()
        )

    def _leadership_token(self) -> int | None:
        controller = self._controller
        if controller is None:
            return None
        led = [scope for scope in controller.scopes.values() if scope.is_leader()]
        return led[0].token if led else None

    def status(self) -> Mapping[str, Any]:
        controller, follower, leader = self._controller, self._follower, self._leader
        body: dict[str, Any] = {
            "replica": self.replica,
            "cluster": self.config.cluster.name,
            "leader": self._leads(),
            "fencing_token": self._leadership_token(),
            "current_leader": dict(leader[0]) if leader else None,
            "current_token": leader[1] if leader else None,
            "ready": self.ready(),
            "not_ready_reason": self.not_ready_reason(),
            "max_loop_stall_s": round(self._max_stall, 4),
            "max_loop_stall_on_cpu_s": round(self._max_stall_on_cpu, 4),
        }
        membership = self._membership
        if membership is not None:
            body["mode"] = "sharded"
            body["shards"] = {
                "total": membership.shards,
                "owned": sorted(membership.owned),
                "members": sorted(membership.members),
                "rebalances": membership.rebalances,
            }
        if follower is not None:
            stats = follower.stats
            body["metadata"] = {
                "synced": follower.synced.is_set(),
                "keys_loaded": stats.keys_loaded,
                "load_seconds": stats.load_seconds,
                "events": stats.events,
                "revision": stats.revision,
            }
        if controller is not None:
            body.update(controller.status())
        return body

    def _report(self) -> None:
        """Readiness to systemd and the metrics, whenever it changes.

        ``STATUS=`` follows the role at every change (e.g. the count of shards owned);
        the log line only when readiness or the reason for not being ready changes, not
        at each of the hundreds of shard grants of a rebalance.
        """
        reason = self.not_ready_reason()
        shown = reason or self._role()
        state = (reason is None, shown)
        if state == self._reported:
            return
        previous, self._reported = self._reported, state
        first_ready = reason is None and (previous is None or not previous[0])
        self.metrics.set_readiness(self._reason_code(reason))
        sdnotify.status(shown)
        if first_ready:
            sdnotify.ready()
            self._announced_ready = True
        if reason is not None or first_ready:
            log.info("daemon.readiness", ready=reason is None, reason=shown)

    def _reason_code(self, reason: str | None) -> str | None:
        """The ``controllerd_not_ready_reason`` label of a reason (a closed set)."""
        if reason is None:
            return None
        for prefix, code in (
            ("stopping", "stopping"),
            ("etcd unreachable", "etcd-unreachable"),
            ("loading", "loading"),
            ("not campaigning", "not-campaigning"),
            ("the broker refuses", "broker-auth"),
            ("election modes mixed", "election-mode-mixed"),
        ):
            if reason.startswith(prefix):
                return code
        return "other"

    def _role(self) -> str:
        if self._membership is not None:
            owned, members = self._membership.owned, self._membership.members
            return (
                f"owning {len(owned)} of {self._membership.shards} shards ({len(members)} members)"
            )
        token = self._leadership_token()
        topics = len(self._controller.view.topics) if self._controller is not None else 0
        if token is not None:
            return f"leading (token {token}, {topics} topics)"
        leader = self._leader
        who = identity_name(leader[0], "none") if leader else "none"
        return f"standing by (leader: {who}, {topics} topics in view)"

    # -- run -----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> int:
        """Run until SIGTERM/SIGINT (0) or a fatal error (non-zero); the exit status."""
        cfg = self.config
        configure_logging(cfg.logging.level, cfg.logging.format)
        log.info(
            "daemon.starting",
            replica=self.replica,
            cluster=cfg.cluster.name,
            config=self.config_path,
            mode=cfg.election.mode,
            profile=cfg.broker.profile,
            metadata_prefix=cfg.metadata_prefix,
        )
        self._log_ignored_env()
        sdnotify.status("starting")
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._signals, name="signals")
            tg.start_soon(self._reloader, name="reloader")
            app = make_ops_app(self.metrics, self.status, self.ready, self.not_ready_reason)
            try:
                self.ops_port = await tg.start(
                    serve_ops, app, cfg.http.host, cfg.http.port, name="ops"
                )
            except OSError as exc:
                raise OperatorError(
                    f"cannot listen on {cfg.http.listen}: {exc.strerror or exc}",
                    setting="http.listen",
                ) from None
            cfg = self.config  # a SIGHUP that came during start-up may have reloaded it
            broker = BrokerClient(
                cfg.broker.admin_url,
                profile=as_profile(cfg.broker.profile),
                token=read_secret(cfg.broker.token_file, "broker.token_file", header=True),
                ca_file=cfg.broker.ca_file,
                cert_file=cfg.broker.cert_file,
                key_file=cfg.broker.key_file,
                timeout=cfg.broker.timeout_seconds,
                max_retries=cfg.broker.max_retries,
                on_request=self._observe_request,
            )
            self._broker = broker
            async with self._open_store() as store, broker:
                task_status.started()
                if store is not None:  # None: stopped before etcd first answered
                    async with open_audit(cfg.audit, self.metrics.audit_messages) as audit:
                        await self._serve(store, broker, audit, tg)
            tg.cancel_scope.cancel()
        log.info("daemon.stopped", replica=self.replica, exit_code=self.exit_code)
        return self.exit_code

    @contextlib.asynccontextmanager
    async def _open_store(self) -> AsyncIterator[Store | None]:
        """The etcd client; waits out an etcd that is down (never exits for it), but a
        refusal of our credentials is an operator error (exit 3).

        Yields None when SIGTERM/SIGINT comes first: the stopper only starts once
        etcd has answered, so each attempt (which authenticates, retrying, when
        ``etcd.username`` is set) and each backoff are raced against ``shutdown``.
        """
        failures = 0
        async with contextlib.AsyncExitStack() as stack:
            while not self.shutdown.is_set():
                connect = functools.partial(
                    stack.enter_async_context, open_configured_store(self.config.etcd)
                )
                try:
                    store = await self._unless_stopping(connect)
                except StoreUnavailable as exc:
                    self._etcd_error = str(exc)
                    self._report()
                    delay = backoff.ELECTION.delay(failures)
                    failures += 1
                    log.warning("etcd.unavailable", error=str(exc), retry_in_s=round(delay, 3))
                    await self._unless_stopping(functools.partial(anyio.sleep, delay))
                except StoreError as exc:
                    raise OperatorError(
                        f"etcd refused us: {exc}",
                        exit_code=EXIT_UNAVAILABLE,
                        setting="etcd.username/etcd.password_file",
                    ) from None
                else:
                    if store is not None:
                        yield store
                        return
            sdnotify.stopping()
            self._report()
            log.info("daemon.stopping", replica=self.replica, etcd="never answered")
            yield None

    async def _unless_stopping(self, work: Callable[[], Awaitable[_T]]) -> _T | None:
        """``work()``, or None if SIGTERM/SIGINT comes first (``work`` is then cancelled).

        ``work``'s exception is raised as it is, not inside an exception group, so
        callers catch it by type and ``run``'s ``except* OperatorError`` still finds it.
        """
        done: list[_T] = []
        failed: list[Exception] = []

        async def stop_when_asked(scope: anyio.CancelScope) -> None:
            await self.shutdown.wait()
            scope.cancel()

        async with anyio.create_task_group() as race:
            race.start_soon(stop_when_asked, race.cancel_scope, name="shutdown-race")
            try:
                done.append(await work())
            except Exception as exc:
                failed.append(exc)
            race.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return done[0] if done else None

    async def _serve(
        self, store: Store, broker: BrokerClient, audit: AuditSink, outer: anyio.abc.TaskGroup
    ) -> None:
        cfg = self.config
        view = MetadataView(self.keys)
        shards = cfg.election.shards if cfg.election.mode == "sharded" else None
        controller = Controller(
            config=self.current_config,
            store=store,
            broker=broker,
            view=view,
            metrics=self.metrics,
            audit=audit,
            clock=self.clock,
            replica=self.replica,
            history=self.history,
            shards=shards,
            on_operator_error=self._operator_error,
        )
        follower = feeding(store, controller, self.clock)
        store.on_watch_reconnect = controller.watch_restarted
        self._controller, self._follower = controller, follower
        async with anyio.create_task_group() as workers:
            # In the outer group: its deadline must outlive the workers it cancels.
            outer.start_soon(self._shutdown_on_signal, workers.cancel_scope, name="stopper")
            for name, work in (
                ("watchdog", self._watchdog),
                ("health", lambda: self._health(store)),
                ("loop-monitor", self._loop_monitor),
                ("leader-watch", lambda: self._leader_watch(store)),
                ("follower", follower.run),
                ("controller", controller.run),
                ("elector", lambda: self._elect(store, controller, follower)),
                ("empty-prefix", lambda: self._warn_when_empty(view, follower)),
            ):
                workers.start_soon(self._guard, name, work, name=name)

    async def _guard(self, name: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run a worker that must live as long as the process; its end is fatal.

        Returning or raising (other than being cancelled on shutdown) means a bug
        or a fatal condition: log it, stop everything, and exit non-zero so the
        supervisor restarts us (issue #10: never exit 0 unless asked to).
        """
        try:
            await work()
        except OperatorError:
            raise
        except Exception:
            log.exception("daemon.worker_failed", worker=name)
            self._fail(EXIT_SOFTWARE)
            return
        if name not in ("watchdog", "empty-prefix") and not self.shutdown.is_set():
            log.error("daemon.worker_ended", worker=name, why="a worker must not end; a bug")
            self._fail(EXIT_SOFTWARE)

    def _fail(self, code: int) -> None:
        if self.exit_code == EXIT_OK:
            self.exit_code = code
        self.shutdown.set()

    def _operator_error(self, kind: str, detail: str) -> None:
        if kind == "broker-auth":
            if self._broker_auth_error is None:
                log.error(
                    "broker.unauthorized",
                    error=detail,
                    fix="give controllerd a token the broker accepts for split, merge and "
                    "/admin/v2/segments (Pulsar: a superuser token; broker.token_file)",
                )
            self._broker_auth_error = detail
            self._report()

    def _log_ignored_env(self) -> None:
        ignored = sorted(
            name
            for name in self.env
            if name.upper().startswith(config_mod.ENV_PREFIX)
            and name.upper() != config_mod.CONFIG_PATH_ENV
            and not config_mod.is_override(name)
        )
        if ignored:
            log.info(
                "config.env.ignored",
                variables=ignored,
                why="not CONTROLLERD_<TABLE>__<KEY>, so not a setting override",
            )

    async def _shutdown_on_signal(self, workers: anyio.CancelScope) -> None:
        await self.shutdown.wait()
        sdnotify.stopping()
        self._report()
        log.info("daemon.stopping", replica=self.replica, deadline_s=SHUTDOWN_DEADLINE)
        controller = self._controller
        if controller is not None:
            for scope in list(controller.scopes):
                controller.revoke(scope)  # stop acting before anything else
        workers.cancel()
        # Normally the whole process has stopped (and cancelled us) long before this.
        await anyio.sleep(SHUTDOWN_DEADLINE)
        log.error("daemon.shutdown_deadline_exceeded", replica=self.replica)
        os._exit(EXIT_SOFTWARE)

    async def _signals(self) -> None:
        """SIGTERM/SIGINT start the shutdown (SIGHUP is the reloader's)."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal.received", signal=signal.Signals(signum).name)
                self.shutdown.set()

    async def _reloader(self) -> None:
        """SIGHUP reloads the config, until the shutdown begins; SIGHUP never kills.

        A SIGHUP that came after the config was read but before this listened
        (:class:`Daemon`'s ``early_hangups``) reloads at once. Once the shutdown has
        begun a SIGHUP reloads nothing (systemd would hear ``RELOADING=1`` after
        ``STOPPING=1``), and when this ends SIGHUP is ignored for the rest of the
        process: its default action ends a process, before the shutdown is done.

        Not anyio's signal receiver: closing it gives the signal back its default
        action, and other threads held the GIL for milliseconds before it could be
        ignored (a SIGHUP then killed the daemon). The handler here is replaced by
        ``SIG_IGN`` in one step; like asyncio's own SIGINT handler
        (``asyncio.Runner``) it only asks the loop to run a callback, which queues
        the reload (one queued covers any that come before it starts).
        """
        loop = asyncio.get_running_loop()
        send, receive = anyio.create_memory_object_stream[None](1)

        def queue() -> None:  # on the loop; a reload already queued covers this one
            with contextlib.suppress(
                anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError
            ):
                send.send_nowait(None)

        def on_hangup(signum: int, frame: FrameType | None) -> None:  # between two bytecodes
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to reload
                loop.call_soon_threadsafe(queue)

        with send, receive:
            signal.signal(signal.SIGHUP, on_hangup)
            try:
                if self._early_hangups() != self._hangups_before_load:
                    log.info("signal.received", signal="SIGHUP", during="start-up")
                    self.reload()
                async for _ in receive:
                    if self.shutdown.is_set():
                        log.info("signal.ignored", signal="SIGHUP", why="stopping")
                    else:
                        self.reload()
            finally:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)

    async def _watchdog(self) -> None:
        interval = sdnotify.watchdog_interval()
        if interval is None:
            return
        while True:
            sdnotify.watchdog()
            await anyio.sleep(interval / 2)

    async def _health(self, store: Store) -> None:
        """Probe etcd every second: readiness means etcd answered, not that we once connected."""
        timeout = min(2.0, self.config.etcd.timeout_seconds)
        while True:
            try:
                await store.probe(self.keys.leader, timeout)
            except StoreUnavailable as exc:
                self._etcd_error = str(exc)
            except StoreError as exc:
                self._etcd_error = str(exc)
                if "auth" in str(exc).lower() or "permission" in str(exc).lower():
                    self.metrics.operator_errors.labels(kind="etcd-auth").inc()
            else:
                self._etcd_error = None
            self.metrics.etcd_up.set(0 if self._etcd_error else 1)
            self._report()
            await anyio.sleep(PROBE_INTERVAL)

    async def _loop_monitor(self) -> None:
        """How late the loop wakes us: the longest stall any task could have caused.

        Also how much of it the loop's thread spent on CPU: at most that much was
        our own work; the rest it waited for a CPU (a host busy with etcd and others);
        and how much the garbage collector took meanwhile. A thread of its own logs
        where the loop is while a stall lasts (``loop.blocked``, with the stack).
        """

        def blocked(seconds: float, stack: list[str]) -> None:
            log.warning("loop.blocked", seconds=round(seconds, 3), stack=stack)

        with GcClock() as collector, BlockWatch(blocked, threshold=LOOP_TICK + 0.1) as watch:
            while True:
                watch.beat()
                before, cpu_before = time.monotonic(), time.thread_time()
                gc_before = collector.seconds
                await anyio.sleep(LOOP_TICK)
                stall = time.monotonic() - before - LOOP_TICK
                on_cpu = min(stall, time.thread_time() - cpu_before)
                self._max_stall = max(self._max_stall, stall)
                self._max_stall_on_cpu = max(self._max_stall_on_cpu, on_cpu)
                self.metrics.event_loop_lag.observe(max(0.0, stall))
                if stall > 0.1:
                    log.warning(
                        "loop.stalled",
                        seconds=round(stall, 3),
                        on_cpu=round(on_cpu, 3),
                        gc=round(collector.seconds - gc_before, 3),
                    )

    async def _leader_watch(self, store: Store) -> None:
        """Keep /status's idea of who leads current, from the leader key."""
        while True:
            try:
                _, revision = await store.get_prefix(self.keys.leader)
                self._leader = await current_leader(store, self.keys.leader)
                async for _ in store.watch_key(self.keys.leader, revision + 1):
                    break  # changed: read it again
            except StoreError as exc:
                log.debug("leader_watch.failed", error=str(exc))
                await anyio.sleep(1.0)

    async def _warn_when_empty(self, view: MetadataView, follower: Follower) -> None:
        """Warn loudly while the metadata prefix holds no topic (a wrong prefix says nothing)."""
        await follower.synced.wait()
        while True:
            if not view.topics:
                log.warning(
                    "metadata.prefix_empty",
                    prefix=self.keys.topics_prefix,
                    hint="no scalable topic under this prefix; Pulsar writes /topics/... at "
                    'the etcd root (etcd.metadata_prefix = ""), the reference broker under '
                    '"/pulsar"',
                )
            await anyio.sleep(EMPTY_PREFIX_WARNING)

    def _observe_request(self, op: str, outcome: str, seconds: float, status: int | None) -> None:
        self.metrics.admin_request_duration.labels(op=op, outcome=outcome).observe(seconds)
        if status is not None and status < 500 and outcome != "unauthorized":
            self.metrics.broker_up.set(1)
        elif outcome == "unavailable":
            self.metrics.broker_up.set(0)
        if outcome == "ok" and op in ("split", "merge", "backlog", "delete_segment"):
            self._broker_auth_error = None

    async def _elect(self, store: Store, controller: Controller, follower: Follower) -> None:
        """Campaign once the view is warm, or earlier for a vacancy no warm replica took;
        lead until the lease cannot be vouched for."""
        await controller.ready.wait()
        if self.config.election.mode == "sharded":
            await follower.synced.wait()
        else:
            await wait_for_turn(
                store, self.keys.leader, follower.synced, grace=LOADING_GRACE, poll=LOADING_POLL
            )
        identity = {
            "replica": self.replica,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "startedAtMs": self.clock.now_ms(),
        }
        if self.config.election.mode == "sharded":
            await self._own_shards(store, controller, identity)
            return
        failures = 0
        while True:
            self._campaigning = True
            self._report()
            try:
                await self._lead_once(store, controller, identity)
                failures = 0
            except StoreError as exc:
                delay = backoff.ELECTION.delay(failures)
                failures += 1
                log.error("election.failed", error=str(exc), retry_in_s=round(delay, 3))
                await anyio.sleep(delay)

    async def _own_shards(
        self, store: Store, controller: Controller, identity: Mapping[str, Any]
    ) -> None:
        """Sharded mode: join the members and act on the shards rendezvous hashing gives us."""

        def grant(shard: int, leadership: Leadership) -> None:
            controller.grant(shard, leadership)
            self.metrics.is_leader.set(1)
            self._report()

        def revoke(shard: int) -> None:
            controller.revoke(shard)
            self.metrics.is_leader.set(1 if controller.scopes else 0)
            self._report()

        membership = ShardMembership(
            store,
            self.config.controller_root,
            self.replica,
            identity,
            self.config.election.shards,
            ttl=self.config.election.lease_ttl_seconds,
            grant=grant,
            revoke=revoke,
            gate=lambda: self._wait_out_other_mode(store, None),
        )
        self._membership = membership
        self._campaigning = True
        self._report()
        await membership.run()

    async def _other_mode(self, store: Store) -> str | None:
        """The replicas of the other election mode that hold their keys, described.

        Both modes look after writing their own key (the leader key; a member key) and
        before acting; etcd's reads are linearizable, so of two replicas that start
        together at least one sees the other and waits: the modes fence with different
        keys, and both acting would act twice on every topic. Only keys on a lease count.
        """
        if self.config.election.mode == "sharded":
            kv = await store.get(self.keys.leader)
            return f"a single-mode leader holds {self.keys.leader}" if kv and kv.lease else None
        members, _ = await store.get_prefix(self.keys.members_prefix)
        live = sum(1 for kv in members if kv.lease)
        return f"{live} sharded replica(s) under {self.keys.members_prefix}" if live else None

    async def _wait_out_other_mode(self, store: Store, lost: anyio.Event | None) -> bool:
        """Return True once no replica of the other election mode holds its key, False if
        ``lost`` is set first. Meanwhile this replica is not ready and says why; an etcd
        error is one more reason to look again, never a reason to act."""
        while True:
            try:
                other = await self._other_mode(store)
                known = True
            except StoreError as exc:
                other, known = None, False
                log.warning("election.mode_check_failed", error=str(exc), retry_in_s=MODE_MIX_POLL)
            if known and other is None:
                if self._mode_mix is not None:
                    log.info("election.mode_mix_cleared", mode=self.config.election.mode)
                    self._mode_mix = None
                    self._report()
                return True
            if other is not None and self._mode_mix != other:
                log.error(
                    "election.mode_mixed",
                    mode=self.config.election.mode,
                    other=other,
                    hint="[election] mode is not a rolling change: stop every replica of "
                    "one mode (docs/operations.md, Upgrade)",
                )
                self._mode_mix = other
                self._report()
            if lost is None:
                await anyio.sleep(MODE_MIX_POLL)
                continue
            with anyio.move_on_after(MODE_MIX_POLL):
                await lost.wait()
            if lost.is_set():
                return False

    async def _lead_once(
        self, store: Store, controller: Controller, identity: Mapping[str, Any]
    ) -> None:
        """Campaign, then lead until leadership is lost."""
        ttl = self.config.election.lease_ttl_seconds
        async with lead(store, self.keys.leader, identity, ttl=ttl) as leadership:
            if not await self._wait_out_other_mode(store, leadership.lost):
                return
            self.metrics.is_leader.set(1)
            self.metrics.fencing_token.set(leadership.token)
            self.metrics.leader_elections.inc()
            log.info("leader.acting", replica=self.replica, token=leadership.token)
            controller.grant(None, leadership)
            self._report()
            try:
                await leadership.lost.wait()
                log.warning("leader.lost", replica=self.replica, token=leadership.token)
            finally:
                controller.revoke(None)
                self.metrics.is_leader.set(0)
                self.metrics.fencing_token.set(0)
                self._report()


class GcClock:
    """Seconds the cyclic garbage collector has run while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, _info: Mapping[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._callback)


async def run(
    config_path: str, env: Mapping[str, str], *, early_hangups: Callable[[], int] | None = None
) -> int:
    """Entry point of ``controllerd run``; returns the exit status.

    ``early_hangups``: the count of SIGHUPs caught while the process started
    (:class:`Daemon`).
    """
    daemon = Daemon(config_path, env, early_hangups=early_hangups)
    try:
        return await daemon.run()
    except* OperatorError as group:
        raise group.exceptions[0] from None


__all__ = ["SHUTDOWN_DEADLINE", "Daemon", "run"]
