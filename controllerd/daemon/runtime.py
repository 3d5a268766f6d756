"""The ``controllerd run`` process: one task group, signals, election, shutdown.

Workers (all named, all owned by one task group; if one dies the process exits
non-zero and the supervisor restarts it):

* ``signals``: SIGHUP reloads the config, SIGTERM/SIGINT start the shutdown.
  The handler only records the signal; the work happens here, on the loop.
* ``ops``: /metrics /healthz /readyz /status.
* ``watchdog``: sd_notify WATCHDOG=1 when systemd asked for it.
* ``leader-watch``: who leads, for /status on standbys.
* ``elector``: campaign; while leading, run a :class:`Controller` in a scope
  cancelled the moment leadership is lost; then campaign again.

Shutdown: stop acting (cancel the leader scope), resign the lease (shielded,
bounded), close clients, exit — all within :data:`SHUTDOWN_DEADLINE`, shorter
than systemd's ``TimeoutStopSec`` and Kubernetes' grace period.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog

from controllerd import config as config_mod
from controllerd.adapters import backoff, sdnotify
from controllerd.adapters.audit import AuditSink, open_audit
from controllerd.adapters.broker import BrokerClient, as_profile
from controllerd.adapters.election import current_leader, lead
from controllerd.adapters.store import Store, StoreError, open_store
from controllerd.core.view import Keys, MetadataView
from controllerd.daemon.clock import Clock, SystemClock
from controllerd.daemon.controller import Controller, DecisionRecord
from controllerd.daemon.logs import configure_logging
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.ops import make_ops_app, serve_ops

log = structlog.get_logger("controllerd.daemon.runtime")

#: Seconds from SIGTERM to exit, at most. systemd's TimeoutStopSec (20 s) and the
#: Kubernetes grace period (30 s) are longer.
SHUTDOWN_DEADLINE = 10.0


def _read_secret(path: str | None) -> str | None:
    """Secrets come from files (systemd EnvironmentFile/credentials, k8s Secrets)."""
    if path is None:
        return None
    return Path(path).read_text(encoding="utf-8").strip()


def open_configured_store(etcd: config_mod.EtcdSettings) -> AbstractAsyncContextManager[Store]:
    """The etcd client as ``[etcd]`` describes it (credentials read from their files)."""
    return open_store(
        etcd.endpoints,
        username=etcd.username,
        password=_read_secret(etcd.password_file),
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
    ) -> None:
        self.config_path = config_path
        self.env = dict(env)
        self.config = config_mod.load_file(config_path, self.env)
        self.clock: Clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        self.keys = Keys(self.config.etcd.metadata_prefix, self.config.controller_root)
        self.history: collections.deque[DecisionRecord] = collections.deque(maxlen=100)
        self.shutdown = anyio.Event()
        self.ops_port: int | None = None
        self._ready = False
        self._controller: Controller | None = None
        self._token: int | None = None
        self._leader: tuple[Mapping[str, Any], int] | None = None
        self._broker: BrokerClient | None = None

    # -- config --------------------------------------------------------------------------

    def reload(self) -> bool:
        """Parse and validate the file again; on any error keep the old config."""
        sdnotify.reloading()
        try:
            new = config_mod.load_file(self.config_path, self.env)
        except config_mod.ConfigError as exc:
            self.metrics.config_reloads.labels(outcome="invalid").inc()
            log.error(
                "config.reload.rejected",
                path=self.config_path,
                errors=exc.errors,
                kept="previous config",
            )
            sdnotify.ready()
            return False
        try:
            token = _read_secret(new.broker.token_file)
        except OSError as exc:
            self.metrics.config_reloads.labels(outcome="invalid").inc()
            log.error(
                "config.reload.rejected",
                path=self.config_path,
                errors=[f"broker.token_file: {exc}"],
                kept="previous config",
            )
            sdnotify.ready()
            return False
        restart = config_mod.restart_required(self.config, new)
        self.config = new
        if self._broker is not None:
            self._broker.set_token(token)
        configure_logging(new.logging.level, new.logging.format)
        self.metrics.config_reloads.labels(outcome="ok").inc()
        log.info("config.reloaded", path=self.config_path, restart_required=restart or None)
        if restart:
            log.warning(
                "config.restart_required",
                settings=restart,
                note="these settings keep their old values until a restart",
            )
        sdnotify.ready()
        return True

    def current_config(self) -> config_mod.Config:
        return self.config

    # -- status --------------------------------------------------------------------------

    def ready(self) -> bool:
        return self._ready

    def status(self) -> Mapping[str, Any]:
        controller = self._controller
        leader = self._leader
        body: dict[str, Any] = {
            "replica": self.replica,
            "cluster": self.config.cluster.name,
            "leader": controller is not None,
            "fencing_token": self._token,
            "current_leader": dict(leader[0]) if leader else None,
            "current_token": leader[1] if leader else None,
        }
        if controller is not None:
            body.update(controller.status())
        else:
            body["last_decisions"] = [
                {"ts_ms": r.ts_ms, "topic": r.topic, "decision": r.decision, "outcome": r.outcome}
                for r in list(self.history)[-20:]
            ]
        return body

    # -- run -----------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        cfg = self.config
        configure_logging(cfg.logging.level, cfg.logging.format)
        log.info(
            "daemon.starting",
            replica=self.replica,
            cluster=cfg.cluster.name,
            config=self.config_path,
        )
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
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._signals, name="signals")
            app = make_ops_app(self.metrics, self.status, self.ready)
            self.ops_port = await tg.start(serve_ops, app, cfg.http.host, cfg.http.port, name="ops")
            broker = BrokerClient(
                cfg.broker.admin_url,
                profile=as_profile(cfg.broker.profile),
                token=_read_secret(cfg.broker.token_file),
                ca_file=cfg.broker.ca_file,
                cert_file=cfg.broker.cert_file,
                key_file=cfg.broker.key_file,
                timeout=cfg.broker.timeout_seconds,
                max_retries=cfg.broker.max_retries,
                on_request=self._observe_request,
            )
            self._broker = broker
            async with (
                open_configured_store(cfg.etcd) as store,
                broker,
                open_audit(cfg.audit, self.metrics.audit_messages) as audit,
            ):
                self._ready = True
                sdnotify.ready()
                task_status.started()
                # Workers that use the clients live in a group that ends before they close.
                async with anyio.create_task_group() as workers:
                    workers.start_soon(self._watchdog, name="watchdog")
                    workers.start_soon(self._leader_watch, store, name="leader-watch")
                    with anyio.CancelScope() as elector_scope:
                        tg.start_soon(self._shutdown_on_signal, elector_scope, name="stopper")
                        await self._elect_and_control(store, broker, audit)
                    self._ready = False
                    workers.cancel_scope.cancel()
            tg.cancel_scope.cancel()
        log.info("daemon.stopped", replica=self.replica)

    async def _shutdown_on_signal(self, elector: anyio.CancelScope) -> None:
        await self.shutdown.wait()
        sdnotify.stopping()
        log.info("daemon.stopping", replica=self.replica, deadline_s=SHUTDOWN_DEADLINE)
        elector.cancel()
        # Normally the task group is cancelled long before this fires.
        await anyio.sleep(SHUTDOWN_DEADLINE)
        log.error("daemon.shutdown_deadline_exceeded", replica=self.replica)
        os._exit(1)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self.reload()
                else:
                    log.info("signal.received", signal=signal.Signals(signum).name)
                    self.shutdown.set()

    async def _watchdog(self) -> None:
        interval = sdnotify.watchdog_interval()
        if interval is None:
            return
        while True:
            sdnotify.watchdog()
            await anyio.sleep(interval / 2)

    async def _leader_watch(self, store: Store) -> None:
        """Keep /status's idea of who leads current, from the leader key."""
        while True:
            try:
                _, revision = await store.get_prefix(self.keys.leader)
                self._leader = await current_leader(store, self.keys.leader)
                async for _ in store.watch_key(self.keys.leader, revision + 1):
                    break  # changed: read it again
            except StoreError as exc:
                log.warning("leader_watch.failed", error=str(exc))
                await anyio.sleep(1.0)

    def _observe_request(self, op: str, outcome: str, seconds: float, status: int | None) -> None:
        self.metrics.admin_request_duration.labels(op=op, outcome=outcome).observe(seconds)

    async def _elect_and_control(
        self, store: Store, broker: BrokerClient, audit: AuditSink
    ) -> None:
        identity = {
            "replica": self.replica,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "startedAtMs": self.clock.now_ms(),
        }
        failures = 0
        while True:
            try:
                await self._lead_once(store, broker, audit, identity)
                failures = 0
            except StoreError as exc:
                failures += 1
                delay = backoff.ELECTION.delay(failures - 1)
                log.error("election.failed", error=str(exc), retry_in_s=delay)
                await anyio.sleep(delay)

    async def _lead_once(
        self, store: Store, broker: BrokerClient, audit: AuditSink, identity: Mapping[str, Any]
    ) -> None:
        """Campaign, then control until leadership is lost."""
        ttl = self.config.election.lease_ttl_seconds
        async with lead(store, self.keys.leader, identity, ttl=ttl) as leadership:
            self._token = leadership.token
            self.metrics.is_leader.set(1)
            self.metrics.fencing_token.set(leadership.token)
            self.metrics.leader_elections.inc()
            log.info("leader.acting", replica=self.replica, token=leadership.token)
            controller = Controller(
                config=self.current_config,
                store=store,
                broker=broker,
                view=MetadataView(self.keys),
                leadership=leadership,
                metrics=self.metrics,
                audit=audit,
                clock=self.clock,
                replica=self.replica,
                history=self.history,
            )
            self._controller = controller
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(controller.run, name="controller")
                    await leadership.lost.wait()
                    log.warning("leader.lost", replica=self.replica, token=leadership.token)
                    tg.cancel_scope.cancel()
            finally:
                self._controller = None
                self._token = None
                self.metrics.is_leader.set(0)


async def run(config_path: str, env: Mapping[str, str]) -> int:
    """Entry point of ``controllerd run``; returns the exit code."""
    daemon = Daemon(config_path, env)
    await daemon.run()
    return 0


async def show_status(config_path: str, env: Mapping[str, str]) -> Mapping[str, Any] | None:
    """Who leads the cluster and with which fencing token (``controllerd status``)."""
    cfg = config_mod.load_file(config_path, env)
    keys = Keys(cfg.etcd.metadata_prefix, cfg.controller_root)
    async with open_configured_store(cfg.etcd) as store:
        leader = await current_leader(store, keys.leader)
    if leader is None:
        return None
    return {"cluster": cfg.cluster.name, "leader": dict(leader[0]), "fencing_token": leader[1]}
