"""Every Prometheus metric of controllerd, defined once.

The metrics live in a dedicated :class:`~prometheus_client.CollectorRegistry`
owned by a :class:`Metrics` instance rather than in the process-global registry,
so that tests and several in-process replicas can each have their own without
"Duplicated timeseries" errors. Names are ``controllerd_*`` with the unit in
the name (``_seconds``, ``_total``); label values are low-cardinality codes
(never topic names: there can be thousands of topics). Every label of a closed
set of values is listed below and its series exist at 0 from the start, so
``rate()``, ``increase()`` and alerts see them before the first event. The
``*_created`` series prometheus_client would add to each counter and histogram
are switched off: nothing reads them, and they double the series count.

docs/operations.md says what each metric means and what to do when it moves;
config/prometheus/controllerd-rules.yaml alerts on them.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Mapping
from importlib import metadata
from typing import Final

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from controllerd.core.model import RATE_NAMES
from controllerd.core.view import KEY_KINDS, REJECT_CAUSES

disable_created_metrics()  # type: ignore[no-untyped-call]

#: A topic evaluation is pure CPU work on one layout: sub-millisecond to a few ms.
EVALUATION_BUCKETS: Final = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Admin calls go to a broker that rewrites metadata: milliseconds to the 10 s timeout.
ADMIN_REQUEST_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Event-loop stalls: a healthy loop is late by under a millisecond; a stall of a
#: second or more delays lease keep-alives (10 s TTL) and the systemd watchdog (30 s).
EVENT_LOOP_LAG_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

AUDIT_OUTCOMES: Final = ("sent", "dropped", "error")
RELOAD_OUTCOMES: Final = ("ok", "invalid")

#: ``controllerd_decisions_total``: every action and the reason codes it can carry
#: (core/policy.py; README "Reason codes").
DECISION_REASONS: Final[Mapping[str, tuple[str, ...]]] = {
    "split": ("consumer-count", *RATE_NAMES),
    "merge": ("cold",),
    "none": (
        "balanced",
        "disabled",
        "policy-invalid",
        "split-cooldown",
        "merge-cooldown",
        "merge-headroom",
        "max-segments",
        "min-split-width",
        "hot-key",
        "consumers",
        "pulsar-autoscaler",
    ),
}
#: ``controllerd_operations_total``: the operations and the outcomes of
#: adapters/broker.py's errors (plus ``ok``).
OPERATION_OPS: Final = ("split", "merge", "prune", "delete_segment")
OPERATION_OUTCOMES: Final = (
    "ok",
    "error",
    "not_found",
    "conflict",
    "fenced",
    "precondition_failed",
    "bug",
    "unauthorized",
    "unaddressable",
    "unavailable",
    "etcd-unavailable",
)
#: ``controllerd_metadata_rejected_total{kind}``: the kinds of etcd key whose
#: values pass the parsing boundary (core/view.py); ``other`` for any other key.
METADATA_KINDS: Final = KEY_KINDS
#: ``controllerd_operator_errors_total{kind}``: mistakes only an operator can fix.
#: broker-auth: the broker answered 401/403 (token); etcd-auth: etcd refused our
#: credentials or permissions; config-reload: a SIGHUP found an invalid config.
OPERATOR_ERROR_KINDS: Final = ("broker-auth", "etcd-auth", "config-reload")
#: ``controllerd_not_ready_reason{reason}``: why /readyz answers 503 (one is 1).
NOT_READY_REASONS: Final = (
    "starting",
    "etcd-unreachable",
    "loading",
    "not-campaigning",
    "broker-auth",
    "election-mode-mixed",
    "stopping",
    "other",
)


def _version() -> str:
    try:
        return metadata.version("controllerd")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


class Metrics:
    """The metric objects, registered in ``registry`` (a fresh one by default).

    A fresh registry also gets the standard ``process_*``, ``python_*`` collectors
    (memory, file descriptors, GC), as the global registry would have. Series with
    a closed set of label values are created at zero up front, so ``rate()`` and
    alerts see them before the first event.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.registry: Final = registry
        r = registry

        # --- leadership --------------------------------------------------
        self.is_leader: Final = Gauge(
            "controllerd_is_leader",
            "1 while this replica holds the leader lease, else 0.",
            registry=r,
        )
        self.fencing_token: Final = Gauge(
            "controllerd_fencing_token",
            "Fencing token (leader key create revision) of this replica's leadership; "
            "0 when not leader.",
            registry=r,
        )
        self.leader_elections: Final = Counter(
            "controllerd_leader_elections_total", "Times this replica became leader.", registry=r
        )

        # --- decisions and actions --------------------------------------
        self.decisions: Final = Counter(
            "controllerd_decisions_total",
            "Policy decisions by action (split|merge|none) and reason code.",
            ["action", "reason"],
            registry=r,
        )
        self.operations: Final = Counter(
            "controllerd_operations_total",
            "Operations attempted, by op (split|merge|delete_segment|prune) and outcome "
            "(ok|error|conflict|fenced|...).",
            ["op", "outcome"],
            registry=r,
        )
        self.evaluation_duration: Final = Histogram(
            "controllerd_evaluation_duration_seconds",
            "Time to evaluate one topic (observe + decide), excluding the action.",
            buckets=EVALUATION_BUCKETS,
            registry=r,
        )
        self.background_paced: Final = Counter(
            "controllerd_background_paced_seconds_total",
            "Seconds background work (the tick's pass, a term's first pass, the GC round) "
            "waited so that watch events and urgent evaluations keep their share of the loop.",
            registry=r,
        )
        self.admin_request_duration: Final = Histogram(
            "controllerd_admin_request_duration_seconds",
            "Broker admin REST request latency, by op and outcome.",
            ["op", "outcome"],
            buckets=ADMIN_REQUEST_BUCKETS,
            registry=r,
        )

        # --- inputs -------------------------------------------------------
        self.topics: Final = Gauge(
            "controllerd_topics", "Scalable topics currently known.", registry=r
        )
        self.load_records_rejected: Final = Counter(
            "controllerd_load_records_rejected_total",
            "Malformed load records skipped, by reason (unparsable|invalid).",
            ["reason"],
            registry=r,
        )
        self.layouts_rejected: Final = Counter(
            "controllerd_layouts_rejected_total",
            "Malformed or invariant-violating layouts skipped, by reason (unparsable|invalid).",
            ["reason"],
            registry=r,
        )
        self.watch_restarts: Final = Counter(
            "controllerd_watch_restarts_total",
            "Times the etcd watch was re-established after an error.",
            registry=r,
        )
        self.state_write_failures: Final = Counter(
            "controllerd_state_write_failures_total",
            "Flushes of the leader's own state (history, cold-since) that etcd refused; "
            "what was not written is written again at the next flush.",
            registry=r,
        )

        # --- garbage collection ------------------------------------------
        self.gc_pruned_segments: Final = Counter(
            "controllerd_gc_pruned_segments_total",
            "Sealed segments removed from layouts (the fenced prune).",
            registry=r,
        )
        self.gc_deleted_segments: Final = Counter(
            "controllerd_gc_deleted_segments_total",
            "Pruned segments whose data the broker deleted (marker removed).",
            registry=r,
        )
        self.gc_pending_deletes: Final = Gauge(
            "controllerd_gc_pending_deletes",
            "Pending-delete markers: pruned segments whose data is not yet deleted.",
            registry=r,
        )

        # --- daemon plumbing ---------------------------------------------
        self.config_reloads: Final = Counter(
            "controllerd_config_reloads_total",
            "SIGHUP config reloads, by outcome (ok|invalid).",
            ["outcome"],
            registry=r,
        )
        self.config_last_reload_ok: Final = Gauge(
            "controllerd_config_last_reload_successful",
            "1 if the config in use is what the file holds (started with it, or the last "
            "SIGHUP reload was valid); 0 after an invalid reload, until a valid one.",
            registry=r,
        )
        self.audit_messages: Final = Counter(
            "controllerd_audit_messages_total",
            "Decision audit records by outcome: sent (acknowledged), dropped (buffer "
            "overflow or unconfirmed at shutdown), error (rejected permanently).",
            ["outcome"],
            registry=r,
        )

        # --- added in 0.2 (definitions; the daemon sets them) ------------
        self.build_info: Final = Gauge(
            "controllerd_build_info",
            "Always 1; the labels say which controllerd and which Python run.",
            ["version", "python"],
            registry=r,
        )
        self.etcd_up: Final = Gauge(
            "controllerd_etcd_up",
            "1 while the last request to etcd succeeded, else 0.",
            registry=r,
        )
        self.broker_up: Final = Gauge(
            "controllerd_broker_up",
            "1 while the last request to the broker admin API got an answer that is not "
            "a transport failure or a 5xx, else 0; NaN before this replica's first one.",
            registry=r,
        )
        # Unknown until a request is made: an idle leader (nothing to split, GC off) makes
        # none, and a 0 here would page ControllerdBrokerDown on a healthy cluster.
        self.broker_up.set(math.nan)
        self.metadata_rejected: Final = Counter(
            "controllerd_metadata_rejected_total",
            "Values read from etcd that failed to parse and were skipped, by key kind.",
            ["kind"],
            registry=r,
        )
        self.ready: Final = Gauge(
            "controllerd_ready",
            "1 while /readyz answers 200 (etcd answered; campaigning or leading), else 0.",
            registry=r,
        )
        self.not_ready_reason: Final = Gauge(
            "controllerd_not_ready_reason",
            "1 for the reason /readyz answers 503, 0 for the others; all 0 when ready.",
            ["reason"],
            registry=r,
        )
        self.topic_retries: Final = Counter(
            "controllerd_topic_retries_total",
            "Topics evaluated again after a failed operation (a retry, not a new decision).",
            registry=r,
        )
        self.shards_owned: Final = Gauge(
            "controllerd_shards_owned",
            "Shards this replica owns (sharded mode; 0 in single mode).",
            registry=r,
        )
        self.topics_owned: Final = Gauge(
            "controllerd_topics_owned", "Topics this replica acts on.", registry=r
        )
        self.event_loop_lag: Final = Histogram(
            "controllerd_event_loop_lag_seconds",
            "How late the event loop woke up for a periodic probe: its stalls.",
            buckets=EVENT_LOOP_LAG_BUCKETS,
            registry=r,
        )
        self.watch_lag_revisions: Final = Gauge(
            "controllerd_watch_lag_revisions",
            "etcd's current revision minus the last revision the metadata watch applied.",
            registry=r,
        )
        self.operator_errors: Final = Counter(
            "controllerd_operator_errors_total",
            "Errors only an operator can fix, by kind (broker-auth|etcd-auth|config-reload).",
            ["kind"],
            registry=r,
        )
        self.pulsar_autoscaler_topics: Final = Gauge(
            "controllerd_pulsar_autoscaler_topics",
            "Topics left to Pulsar's own auto-scaler, which controllerd does not act on.",
            registry=r,
        )

        self.build_info.labels(version=_version(), python=platform.python_version()).set(1)
        for outcome in AUDIT_OUTCOMES:
            self.audit_messages.labels(outcome=outcome)
        for outcome in RELOAD_OUTCOMES:
            self.config_reloads.labels(outcome=outcome)
        self.config_last_reload_ok.set(1)  # the config started with was valid
        for action, reasons in DECISION_REASONS.items():
            for reason in reasons:
                self.decisions.labels(action=action, reason=reason)
        for op in OPERATION_OPS:
            for outcome in OPERATION_OUTCOMES:
                self.operations.labels(op=op, outcome=outcome)
        for kind in METADATA_KINDS:
            self.metadata_rejected.labels(kind=kind)
        for cause in REJECT_CAUSES:
            self.load_records_rejected.labels(reason=cause)
            self.layouts_rejected.labels(reason=cause)
        for kind in OPERATOR_ERROR_KINDS:
            self.operator_errors.labels(kind=kind)
        self.set_readiness("starting")

    def set_readiness(self, not_ready: str | None) -> None:
        """Ready (``None``) or not, with the reason; an unknown reason counts as ``other``.

        Keeps ``controllerd_ready`` and the one-hot ``controllerd_not_ready_reason``
        consistent: at most one reason is 1, and none while ready.
        """
        if not_ready is not None and not_ready not in NOT_READY_REASONS:
            not_ready = "other"
        self.ready.set(1 if not_ready is None else 0)
        for reason in NOT_READY_REASONS:
            self.not_ready_reason.labels(reason=reason).set(1 if reason == not_ready else 0)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of the registry and its content type.

        Declared as text format 0.0.4, as prometheus_client's own exporter does
        by default: every Prometheus version parses it, and our names need none
        of the escaping that format 1.0.0 negotiates.
        """
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
