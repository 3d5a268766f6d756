"""``controllerd refbroker``: the reference broker process (admin API + load reporter).

Start-up mistakes (an unreadable ``--token-file``, Kafka unreachable for
``--connect-timeout`` seconds, an invalid ``--config``, a busy ``--listen`` port)
end the process with one line on stderr and the exit status of
:mod:`controllerd.errors`, never a traceback. SIGTERM stops it with status 0,
SIGINT (Ctrl-C) with 130, as for every command but ``run``.

The config is ``--config`` (``-``: stdin; none: the defaults) with the ``CONTROLLERD_*``
overrides of the environment applied, as the daemon loads it: the fencing key
comes from ``cluster.name``, so both must see the same overrides.

etcd is opened as the daemon opens it (:func:`~controllerd.daemon.runtime.open_configured_store`):
the config's ``[etcd]`` user, password file, CA bundle and client certificate, on
``--etcd`` when given, else on ``etcd.endpoints``. An etcd that does not answer is
waited out at start-up, for as long as it takes (the daemon does the same); one that
refuses us (a wrong password, no user while authentication is on, a user without
permission on the broker's keys) ends the process with status 3 and one line naming
the setting, instead of a broker answering 503 to every call.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.abc
import structlog

from controllerd import config as config_mod
from controllerd.adapters import backoff
from controllerd.adapters.secrets import config_file_errors, read_secret
from controllerd.adapters.store import Store, StoreError, StoreUnavailable, endpoints_problem
from controllerd.core.loadreport import ReportRule
from controllerd.core.shards import DEFAULT_SHARDS
from controllerd.core.view import Keys
from controllerd.daemon.clock import Clock, SystemClock
from controllerd.daemon.logs import configure_logging
from controllerd.daemon.ops import serve_ops
from controllerd.daemon.runtime import open_configured_store
from controllerd.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, OperatorError
from controllerd.refbroker.kafka import open_kafka
from controllerd.refbroker.options import DEFAULT_CONNECT_TIMEOUT, add_arguments
from controllerd.refbroker.reporter import LoadReporter
from controllerd.refbroker.server import RefBroker, make_app

log = structlog.get_logger("controllerd.refbroker")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    """Everything :func:`serve` needs. ``leader_key`` None turns fencing off.

    etcd is reached as ``config.etcd`` says (credentials, TLS, request timeout), on
    the endpoint ``etcd`` (``--etcd``), or on ``config.etcd.endpoints`` when it is None.
    """

    etcd: str | None
    kafka: str
    host: str
    port: int
    metadata_prefix: str
    leader_key: str | None
    report_interval: float
    config: config_mod.Config
    token: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    #: Shard count of sharded mode; None = ``[election] shards`` of ``config``.
    shards: int | None = None


def etcd_settings(cfg: config_mod.Config, endpoint: str | None) -> config_mod.EtcdSettings:
    """``[etcd]`` of ``cfg``, with ``endpoint`` (``--etcd``, when given) as its only endpoint."""
    if endpoint is None:
        return cfg.etcd
    return dataclasses.replace(cfg.etcd, endpoints=(endpoint,))


def shard_count(cfg: config_mod.Config) -> int:
    """``[election] shards`` (256 when the config has no such setting)."""
    return int(getattr(cfg.election, "shards", DEFAULT_SHARDS))


async def serve(
    options: BrokerOptions,
    *,
    clock: Clock | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled; reports the bound admin port once listening.

    Kafka is opened first, so that a Kafka that is down ends the process after
    ``connect_timeout`` even while etcd is down too; then etcd, waited for without a
    deadline (see :func:`open_etcd`).

    Raises:
        OperatorError: Kafka did not answer within ``connect_timeout``, etcd refused
            our credentials or our reads, or the admin address cannot be resolved or
            bound (a busy port).
    """
    clock = clock or SystemClock()
    cfg = options.config
    keys = Keys(options.metadata_prefix, cfg.controller_root)
    rule = ReportRule(
        split_thresholds=cfg.policy.split_thresholds,
        merge_thresholds=cfg.policy.merge_thresholds,
        rate_change_threshold=cfg.load_report.rate_change_threshold,
        max_interval_seconds=cfg.load_report.report_max_interval_seconds,
        threshold_crossing=cfg.load_report.threshold_crossing,
    )
    etcd = etcd_settings(cfg, options.etcd)
    # what the broker reads on every call: its metadata and the fencing key
    probes = [keys.topics_prefix, *([options.leader_key] if options.leader_key else [])]
    async with (
        open_kafka(options.kafka, options.connect_timeout) as kafka,
        open_etcd(etcd, probes) as store,
    ):
        shards = options.shards if options.shards is not None else shard_count(cfg)
        broker = RefBroker(store, keys, kafka, clock, options.leader_key, shards)
        reporter = LoadReporter(store, keys, kafka, rule, clock, options.report_interval)
        async with anyio.create_task_group() as tg:
            app = make_app(broker, options.token)
            try:
                port = await tg.start(serve_ops, app, options.host, options.port)
            except OSError as exc:
                raise OperatorError(
                    f"cannot listen on {_address(options.host, options.port)}: "
                    f"{exc.strerror or exc}",
                    setting="--listen",
                ) from None
            log.info(
                "refbroker.listening",
                port=port,
                etcd=", ".join(etcd.endpoints),
                kafka=options.kafka,
                authentication=options.token is not None,
                fencing_key=options.leader_key,
            )
            task_status.started(port)
            tg.start_soon(reporter.run, name="load-reporter")


@contextlib.asynccontextmanager
async def open_etcd(etcd: config_mod.EtcdSettings, probes: Sequence[str]) -> AsyncIterator[Store]:
    """The etcd client as ``etcd`` describes it, once etcd has answered a read of each
    key of ``probes``: a refusal shows at start-up, not as a 503 on every call.

    An etcd that does not answer (down, no leader, a TLS handshake it refuses) is
    retried on the daemon's schedule (``backoff.ELECTION``), one
    ``refbroker.etcd.retry`` warning per retry, for as long as it takes: an outage is
    not the operator's mistake. SIGTERM/SIGINT still stop the process meanwhile.

    Raises:
        OperatorError: etcd refused our credentials (``etcd.username/etcd.password_file``),
            or refused to let us read a key (``etcd.username``: its roles), with
            :data:`~controllerd.errors.EXIT_UNAVAILABLE`, as ``controllerd run`` does.
    """
    where = ", ".join(etcd.endpoints)
    async with contextlib.AsyncExitStack() as stack:
        try:  # with a user, opening authenticates: a refusal here is the credentials'
            store = await _until_etcd_answers(
                etcd, lambda: stack.enter_async_context(open_configured_store(etcd))
            )
        except StoreError as exc:
            raise OperatorError(
                f"etcd at {where} refused us: {exc}",
                exit_code=EXIT_UNAVAILABLE,
                setting="etcd.username/etcd.password_file" if etcd.username else "etcd.username",
            ) from None
        for key in probes:  # etcd knows who we are (or that we did not say): the user's rights
            try:
                await _until_etcd_answers(
                    etcd, functools.partial(store.probe, key, etcd.timeout_seconds)
                )
            except StoreError as exc:
                raise OperatorError(
                    f"etcd at {where} refused us a read of {key}: {exc}",
                    exit_code=EXIT_UNAVAILABLE,
                    setting="etcd.username",
                ) from None
        yield store


async def _until_etcd_answers(
    etcd: config_mod.EtcdSettings, attempt: Callable[[], Awaitable[_T]]
) -> _T:
    """``attempt()``, again after each :class:`StoreUnavailable` until it succeeds.

    Raises:
        StoreError: etcd answered with a refusal (anything but unavailable).
    """
    failures = 0
    while True:
        try:
            return await attempt()
        except StoreUnavailable as exc:
            delay = backoff.ELECTION.delay(failures)
            failures += 1
            log.warning(
                "refbroker.etcd.retry",
                etcd=", ".join(etcd.endpoints),
                attempt=failures,
                delay=round(delay, 3),
                error=str(exc),
            )
            await anyio.sleep(delay)


def _address(host: str, port: int) -> str:
    """``host:port`` as ``--listen`` takes it: an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _main(options: BrokerOptions) -> int:
    """Serve until SIGTERM (status 0: stopped on request) or SIGINT (130: interrupted)."""
    status = EXIT_OK
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, options, name="refbroker")
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("refbroker.stopping", signal=signum.name)
                if signum == signal.SIGINT:
                    status = EXIT_INTERRUPTED
                tg.cancel_scope.cancel()
                break
    return status


def _operator_error(exc: BaseException) -> OperatorError | None:
    """The OperatorError inside ``exc``, however deeply task groups wrapped it."""
    if isinstance(exc, OperatorError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _operator_error(inner)
            if found is not None:
                return found
    return None


def _config(path: str | None) -> config_mod.Config:
    """``path`` (None: the defaults; ``-``: stdin) with the environment's overrides, as
    the daemon loads it. The broker reads its config once, so stdin can serve.

    An error names ``--config`` when there is a file; one caused by a variable names it.
    """
    setting = "--config" if path else None
    try:
        if path:  # "-" is stdin
            return config_mod.load_file(path, os.environ)
        return config_mod.load("", os.environ)
    except config_mod.ConfigError as exc:
        raise OperatorError("; ".join(exc.errors), setting=setting) from None


def _seconds(flag: str, value: float) -> float:
    """``value`` if it is a finite number of seconds > 0: ``inf`` would sleep forever."""
    if not (value > 0 and math.isfinite(value)):
        raise OperatorError(f"{flag} must be a finite number > 0 (got {value})", setting=flag)
    return value


def _check_etcd_files(path: str | None, cfg: config_mod.Config, endpoint: str | None) -> None:
    """Refuse what ``controllerd run`` refuses in ``[etcd]`` before it starts: files
    that cannot serve (an unreadable password file, a CA bundle that is not PEM, a
    certificate without its key), a user without a password file, unusable endpoints
    (not checked when ``--etcd``, ``endpoint``, replaces them).

    Only ``etcd.*``: the config's ``[broker]`` files are the controller's, not ours.

    Raises:
        OperatorError: the first such problem and how many more (EXIT_USAGE).
    """
    cfg = dataclasses.replace(cfg, etcd=etcd_settings(cfg, endpoint))
    problems = [p for p in config_file_errors(cfg) if p.startswith("etcd.")]
    if problems:
        where = f"{'<stdin>' if path == '-' else path}: " if path else ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        setting = problems[0].partition(":")[0]
        raise OperatorError(f"{where}{problems[0]}{more}", setting=setting)


def _options(args: argparse.Namespace, cfg: config_mod.Config | None = None) -> BrokerOptions:
    cfg = _config(args.config) if cfg is None else cfg
    # an empty host (":8080", or "8080") is the loopback address, as it always was here
    host_part = args.listen.rpartition(":")[0]
    address = args.listen if host_part else f"127.0.0.1:{args.listen.removeprefix(':')}"
    listen = config_mod.split_listen(address)
    if listen is None:
        raise OperatorError(
            f"--listen {args.listen!r} is not host:port (a port 0-65535; an IPv6 host in [])",
            setting="--listen",
        )
    host, port = listen
    connect_timeout = _seconds("--connect-timeout", args.connect_timeout)
    report_interval = _seconds("--report-interval", args.report_interval)
    token = read_secret(args.token_file, "--token-file", header=True)
    if args.etcd is not None and (problem := endpoints_problem([args.etcd])) is not None:
        raise OperatorError(f"--etcd {args.etcd!r}: {problem}", setting="--etcd")
    _check_etcd_files(args.config, cfg, args.etcd)
    if not config_mod.is_bootstrap_server(args.kafka):
        raise OperatorError(f"--kafka {args.kafka!r} is not host[:port]", setting="--kafka")
    keys = (("--metadata-prefix", args.metadata_prefix), ("--leader-key", args.leader_key))
    for flag, value in keys:
        if value and not (value.startswith("/") and not value.endswith("/")):
            raise OperatorError(
                f"{flag} {value!r} must start with '/' and not end with '/'", setting=flag
            )
    return BrokerOptions(
        etcd=args.etcd,
        kafka=args.kafka,
        host=host,
        port=port,
        metadata_prefix=args.metadata_prefix,
        leader_key=args.leader_key or f"{cfg.controller_root}/leader",
        report_interval=report_interval,
        config=cfg,
        token=token,
        connect_timeout=connect_timeout,
    )


def cmd_refbroker(args: argparse.Namespace, config: config_mod.Config | None = None) -> int:
    """Run the broker; an operator's mistake is one ``controllerd: ...`` line and its status.

    ``config``: ``--config`` as the caller already loaded it (stdin cannot be read twice);
    None = load it here.
    """
    try:
        options = _options(args, config)
        cfg = options.config
        configure_logging(cfg.logging.level, cfg.logging.format)
        try:
            status: int = anyio.run(_main, options)
        except BaseException as exc:
            found = _operator_error(exc)
            if found is None:
                raise
            raise found from None
    except OperatorError as exc:
        print(f"controllerd: {exc.line()}", file=sys.stderr)
        return exc.exit_code
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m controllerd.refbroker.main``: the same command as ``controllerd refbroker``."""
    parser = argparse.ArgumentParser(
        prog="controllerd refbroker",
        description="Run the reference broker (admin API over etcd + Kafka).",
    )
    add_arguments(parser)
    return cmd_refbroker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
