"""``controllerd refbroker``: the reference broker process (admin API + load reporter)."""

from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from controllerd import config as config_mod
from controllerd.adapters.store import open_store
from controllerd.core.loadreport import ReportRule
from controllerd.core.view import Keys
from controllerd.daemon.clock import Clock, SystemClock
from controllerd.daemon.logs import configure_logging
from controllerd.daemon.ops import serve_ops
from controllerd.refbroker.kafka import open_kafka
from controllerd.refbroker.reporter import LoadReporter
from controllerd.refbroker.server import RefBroker, make_app

log = structlog.get_logger("controllerd.refbroker")


@dataclass(frozen=True, slots=True)
class BrokerOptions:
    etcd: str
    kafka: str
    host: str
    port: int
    metadata_prefix: str
    leader_key: str | None
    report_interval: float
    config: config_mod.Config


async def serve(
    options: BrokerOptions,
    *,
    clock: Clock | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled; reports the bound admin port once listening."""
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
    async with open_store([options.etcd]) as store, open_kafka(options.kafka) as kafka:
        broker = RefBroker(store, keys, kafka, clock, options.leader_key)
        reporter = LoadReporter(store, keys, kafka, rule, clock, options.report_interval)
        async with anyio.create_task_group() as tg:
            port = await tg.start(serve_ops, make_app(broker), options.host, options.port)
            log.info("refbroker.listening", port=port, etcd=options.etcd, kafka=options.kafka)
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


def cmd_refbroker(args: argparse.Namespace) -> int:
    cfg = config_mod.load_file(args.config) if args.config else config_mod.Config()
    host, _, port = args.listen.rpartition(":")
    configure_logging(cfg.logging.level, cfg.logging.format)
    options = BrokerOptions(
        etcd=args.etcd,
        kafka=args.kafka,
        host=host or "127.0.0.1",
        port=int(port),
        metadata_prefix=args.metadata_prefix,
        leader_key=args.leader_key or f"{cfg.controller_root}/leader",
        report_interval=args.report_interval,
        config=cfg,
    )
    anyio.run(_main, options)
    return 0
