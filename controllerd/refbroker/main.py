"""``controllerd refbroker``: the reference broker process (admin API + load reporter).

Start-up mistakes (an unreadable ``--token-file``, Kafka unreachable for
``--connect-timeout`` seconds, an invalid ``--config``) end the process with one
line on stderr and the exit status of :mod:`controllerd.errors`, never a
traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from controllerd import config as config_mod
from controllerd.adapters.secrets import read_secret
from controllerd.adapters.store import endpoints_problem, open_store
from controllerd.core.loadreport import ReportRule
from controllerd.core.shards import DEFAULT_SHARDS
from controllerd.core.view import Keys
from controllerd.daemon.clock import Clock, SystemClock
from controllerd.daemon.logs import configure_logging
from controllerd.daemon.ops import serve_ops
from controllerd.errors import EXIT_OK, OperatorError
from controllerd.refbroker.kafka import open_kafka
from controllerd.refbroker.options import DEFAULT_CONNECT_TIMEOUT, add_arguments
from controllerd.refbroker.reporter import LoadReporter
from controllerd.refbroker.server import RefBroker, make_app

log = structlog.get_logger("controllerd.refbroker")


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    """Everything :func:`serve` needs. ``leader_key`` None turns fencing off."""

    etcd: str
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

    Raises:
        OperatorError: Kafka did not answer within ``connect_timeout``.
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
    async with (
        open_store([options.etcd]) as store,
        open_kafka(options.kafka, options.connect_timeout) as kafka,
    ):
        shards = options.shards if options.shards is not None else shard_count(cfg)
        broker = RefBroker(store, keys, kafka, clock, options.leader_key, shards)
        reporter = LoadReporter(store, keys, kafka, rule, clock, options.report_interval)
        async with anyio.create_task_group() as tg:
            app = make_app(broker, options.token)
            port = await tg.start(serve_ops, app, options.host, options.port)
            log.info(
                "refbroker.listening",
                port=port,
                etcd=options.etcd,
                kafka=options.kafka,
                authentication=options.token is not None,
                fencing_key=options.leader_key,
            )
            task_status.started(port)
            tg.start_soon(reporter.run, name="load-reporter")


async def _main(options: BrokerOptions) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve, options, name="refbroker")
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                log.info("refbroker.stopping")
                tg.cancel_scope.cancel()
                break


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


def _options(args: argparse.Namespace) -> BrokerOptions:
    try:
        cfg = config_mod.load_file(args.config) if args.config else config_mod.Config()
    except config_mod.ConfigError as exc:
        raise OperatorError("; ".join(exc.errors), setting="--config") from None
    except OSError as exc:
        raise OperatorError(
            f"cannot read {args.config}: {exc.strerror}", setting="--config"
        ) from None
    host, _, port = args.listen.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise OperatorError(f"--listen {args.listen!r} is not host:port", setting="--listen")
    if not args.connect_timeout > 0:
        raise OperatorError("--connect-timeout must be > 0", setting="--connect-timeout")
    if not args.report_interval > 0:
        raise OperatorError("--report-interval must be > 0", setting="--report-interval")
    token = read_secret(args.token_file, "--token-file")
    if (problem := endpoints_problem([args.etcd])) is not None:
        raise OperatorError(f"--etcd {args.etcd!r}: {problem}", setting="--etcd")
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
        host=host or "127.0.0.1",
        port=int(port),
        metadata_prefix=args.metadata_prefix,
        leader_key=args.leader_key or f"{cfg.controller_root}/leader",
        report_interval=args.report_interval,
        config=cfg,
        token=token,
        connect_timeout=args.connect_timeout,
    )


def cmd_refbroker(args: argparse.Namespace) -> int:
    """Run the broker; an operator's mistake is one ``controllerd: ...`` line and its status."""
    try:
        options = _options(args)
        cfg = options.config
        configure_logging(cfg.logging.level, cfg.logging.format)
        try:
            anyio.run(_main, options)
        except BaseException as exc:
            found = _operator_error(exc)
            if found is None:
                raise
            raise found from None
    except OperatorError as exc:
        print(f"controllerd: {exc.line()}", file=sys.stderr)
        return exc.exit_code
    return EXIT_OK


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
