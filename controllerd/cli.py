"""The ``controllerd`` command line.

Each subcommand is a thin shell over the core or the runtime; heavy modules are
imported inside the command so that ``decide`` and ``check-config`` start fast
and need none of the daemon's dependencies. Exit codes: 0 success, 1 a failed
check, 2 unusable input (argparse uses 2 for bad usage too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from controllerd import config as config_mod
from controllerd.core import layout as layout_mod
from controllerd.core.model import (
    LoadSample,
    ModelError,
    decision_to_json,
    layout_from_json,
    load_sample_from_json,
)
from controllerd.core.policy import decide, resolve_policy
from controllerd.pipeline.cli import add_commands as add_pipeline_commands

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class InputError(Exception):
    """Malformed user input; the message says which file and field."""


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    print(f"controllerd: {message}", file=sys.stderr)
    raise SystemExit(code)


def _read_json(path: str, what: str) -> Any:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} {path}: not JSON: {exc}") from None


def parse_loads(obj: Any, path: str) -> dict[int, LoadSample]:
    """``LOAD.json``: segment id -> load record."""
    if not isinstance(obj, Mapping):
        raise InputError(f"load {path}: expected an object keyed by segment id")
    loads: dict[int, LoadSample] = {}
    for key, record in obj.items():
        try:
            sid = int(key)
        except ValueError:
            raise InputError(f"load {path}: key {key!r} is not a segment id") from None
        try:
            loads[sid] = load_sample_from_json(record, f"load[{key}]")
        except ModelError as exc:
            raise InputError(f"load {path}: {exc}") from None
    return loads


def parse_consumers(obj: Any, path: str) -> dict[str, int]:
    """``C.json``: subscription -> consumer count, or -> {"type", "consumers"}.

    QUEUE subscriptions do not count (DESIGN §6: STREAM/CHECKPOINT only).
    """
    if not isinstance(obj, Mapping):
        raise InputError(f"consumers {path}: expected an object keyed by subscription")
    counts: dict[str, int] = {}
    for sub, entry in obj.items():
        kind, count = "STREAM", entry
        if isinstance(entry, Mapping):
            kind, count = str(entry.get("type", "STREAM")).upper(), entry.get("consumers")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InputError(
                f"consumers {path}: {sub}: expected a consumer count >= 0, got {count!r}"
            )
        if kind != "QUEUE":
            counts[str(sub)] = count
    return counts


def cmd_decide(args: argparse.Namespace) -> int:
    try:
        raw_layout = _read_json(args.layout, "layout")
        try:
            topic_layout = layout_mod.check(layout_from_json(raw_layout))
        except (ModelError, layout_mod.LayoutError) as exc:
            raise InputError(f"layout {args.layout}: {exc}") from None
        loads = parse_loads(_read_json(args.load, "load"), args.load)
        consumers = (
            parse_consumers(_read_json(args.consumers, "consumers"), args.consumers)
            if args.consumers
            else {}
        )
    except InputError as exc:
        _fail(str(exc))
    settings = _load_config(args.config, EXIT_BAD_INPUT).policy
    policy = resolve_policy(settings, topic_layout.auto_scale_policy)
    decision = decide(
        topic_layout, loads, consumers, policy, args.now_ms, args.last_split_ms, args.last_merge_ms
    )
    print(json.dumps(decision_to_json(decision)))
    return EXIT_OK


def _load_config(path: str | None, exit_code: int) -> config_mod.Config:
    try:
        if path is None:
            return config_mod.load("", os.environ)
        return config_mod.load_file(path, os.environ)
    except config_mod.ConfigError as exc:
        for error in exc.errors:
            print(f"{path or '<defaults>'}: {error}", file=sys.stderr)
        raise SystemExit(exit_code) from None


def cmd_check_config(args: argparse.Namespace) -> int:
    _load_config(args.file, EXIT_FAILED)
    print(f"{args.file}: ok")
    return EXIT_OK


def _config_path(args: argparse.Namespace) -> str:
    path: str | None = args.config or os.environ.get("CONTROLLERD_CONFIG")
    if not path:
        _fail("--config FILE (or CONTROLLERD_CONFIG) is required")
    return path


def cmd_run(args: argparse.Namespace) -> int:
    import anyio

    from controllerd.daemon import runtime

    path = _config_path(args)
    _load_config(path, EXIT_BAD_INPUT)  # refuse an invalid config before starting anything
    return anyio.run(runtime.run, path, dict(os.environ))


def cmd_status(args: argparse.Namespace) -> int:
    import anyio

    from controllerd.daemon import runtime

    path = _config_path(args)
    _load_config(path, EXIT_BAD_INPUT)
    status = anyio.run(runtime.show_status, path, dict(os.environ))
    if status is None:
        print(json.dumps({"leader": None, "fencing_token": None}))
        return EXIT_FAILED
    print(json.dumps(status))
    return EXIT_OK


def cmd_refbroker(args: argparse.Namespace) -> int:
    from controllerd.refbroker.main import cmd_refbroker as refbroker

    if args.config:
        _load_config(args.config, EXIT_BAD_INPUT)
    return refbroker(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from controllerd.demo import cmd_demo as demo

    return demo(args.keep)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="controllerd",
        description="Split, merge and garbage-collect the segments of scalable topics.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("decide", help="run the policy once on files; print the decision as JSON")
    p.add_argument("--layout", required=True, metavar="L.json", help="ScalableTopicMetadata JSON")
    p.add_argument("--load", required=True, metavar="LOAD.json", help="segment id -> load record")
    p.add_argument("--consumers", metavar="C.json", help="subscription -> consumer count")
    p.add_argument("--config", metavar="controllerd.toml", help="policy settings (else defaults)")
    p.add_argument("--now-ms", required=True, type=int, metavar="N")
    p.add_argument("--last-split-ms", type=int, metavar="N")
    p.add_argument("--last-merge-ms", type=int, metavar="N")
    p.set_defaults(func=cmd_decide)

    p = sub.add_parser("run", help="run a controller replica (leader-elected through etcd)")
    p.add_argument("--config", metavar="FILE", help="controllerd.toml (or $CONTROLLERD_CONFIG)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="print who leads the cluster and the fencing token")
    p.add_argument("--config", metavar="FILE", help="controllerd.toml (or $CONTROLLERD_CONFIG)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="run everything on 127.0.0.1 and show it split, merge, GC")
    p.add_argument("--keep", action="store_true", help="keep the work directory with the logs")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("refbroker", help="run the reference broker (admin API over etcd + Kafka)")
    p.add_argument("--etcd", default="http://127.0.0.1:2379", help="etcd endpoint URL")
    p.add_argument("--kafka", default="127.0.0.1:9092", help="Kafka bootstrap host:port")
    p.add_argument("--listen", default="127.0.0.1:8080", help="admin API host:port")
    p.add_argument("--metadata-prefix", default="/pulsar")
    p.add_argument(
        "--leader-key",
        help="controller leader key checked against X-Fencing-Token "
        "(default: <controller_prefix>/<cluster>/leader from --config)",
    )
    p.add_argument("--report-interval", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--config", help="controllerd.toml: thresholds and [load_report] rules")
    p.set_defaults(func=cmd_refbroker)

    p = sub.add_parser("check-config", help="validate a config file; print every error")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(func=cmd_check_config)

    add_pipeline_commands(sub)  # backtest, record (heavy imports happen inside them)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
