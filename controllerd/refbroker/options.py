"""The options of ``controllerd refbroker``, kept free of heavy imports.

``controllerd.cli`` builds its parser from :func:`add_arguments` at start-up
(every command's parser is built on every run), so this module imports nothing
but argparse; ``controllerd.refbroker.main`` does the work.
"""

from __future__ import annotations

import argparse

DEFAULT_CONNECT_TIMEOUT = 30.0
"""Seconds ``refbroker`` keeps retrying an unreachable Kafka at start-up."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``refbroker`` option to ``parser``."""
    parser.add_argument(
        "--etcd",
        metavar="URL",
        help="etcd endpoint URL (default: etcd.endpoints of --config, http://127.0.0.1:2379 "
        "without one); credentials and TLS always come from [etcd] of --config",
    )
    parser.add_argument("--kafka", default="127.0.0.1:9092", help="Kafka bootstrap host:port")
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8080",
        help="admin API host:port; an IPv6 host in brackets ([::1]:8080)",
    )
    parser.add_argument(
        "--metadata-prefix", default="/pulsar", help="etcd prefix of the PIP-468 metadata"
    )
    parser.add_argument(
        "--leader-key",
        help="controller leader key checked against X-Fencing-Token "
        "(default: <controller_prefix>/<cluster>/leader from --config)",
    )
    parser.add_argument(
        "--report-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between two measurements of every active segment",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the bearer token every admin request must carry "
        "(Authorization: Bearer <token>); without it the API is open",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="how long to keep retrying an unreachable Kafka at start-up "
        f"(default {DEFAULT_CONNECT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--config",
        help="controllerd.toml: [etcd] endpoints, user, password file and TLS files; "
        "thresholds, [load_report] rules, [election] shards",
    )
