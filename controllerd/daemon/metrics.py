"""Every Prometheus metric of controllerd, defined once.

The metrics live in a dedicated :class:`~prometheus_client.CollectorRegistry`
owned by a :class:`Metrics` instance rather than in the process-global registry,
so that tests and several in-process replicas can each have their own without
"Duplicated timeseries" errors. Names are ``controllerd_*`` with the unit in
the name (``_seconds``, ``_total``); label values are low-cardinality codes
(never topic names: there can be thousands of topics).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from controllerd.core.view import KEY_KINDS

#: A topic evaluation is pure CPU work on one layout: sub-millisecond to a few ms.
EVALUATION_BUCKETS: Final = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Admin calls go to a broker that rewrites metadata: milliseconds to the 10 s timeout.
ADMIN_REQUEST_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

AUDIT_OUTCOMES: Final = ("sent", "dropped", "error")
RELOAD_OUTCOMES: Final = ("ok", "invalid")
OPERATOR_ERROR_KINDS: Final = ("broker-auth", "config-reload", "etcd-auth")


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
            "Malformed load records skipped, by reason.",
            ["reason"],
            registry=r,
        )
        self.layouts_rejected: Final = Counter(
            "controllerd_layouts_rejected_total",
            "Malformed or invariant-violating layouts skipped, by reason.",
            ["reason"],
            registry=r,
        )
        self.metadata_rejected: Final = Counter(
            "controllerd_metadata_rejected_total",
            "Values read from etcd that could not be used, by key kind (layout, load, ...): "
            "skipped and logged, never fatal.",
            ["kind"],
            registry=r,
        )
        self.topic_retries: Final = Counter(
            "controllerd_topic_retries_total",
            "Evaluations that decided again an operation that had failed (a retry, not a "
            "new decision).",
            registry=r,
        )
        self.operator_errors: Final = Counter(
            "controllerd_operator_errors_total",
            "Problems only an operator can fix, by kind (broker-auth: the broker refuses our "
            "token; config-reload: a SIGHUP found an invalid config).",
            ["kind"],
            registry=r,
        )
        self.etcd_up: Final = Gauge(
            "controllerd_etcd_up", "1 while etcd answered our last probe, else 0.", registry=r
        )
        self.broker_up: Final = Gauge(
            "controllerd_broker_up",
            "1 while the broker answered our last admin request (any status below 500).",
            registry=r,
        )
        self.loop_stall: Final = Histogram(
            "controllerd_event_loop_stall_seconds",
            "How late the event loop woke a 50 ms timer: the longest any task held the loop.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.ready_gauge: Final = Gauge(
            "controllerd_ready", "1 while /readyz answers 200, else 0.", registry=r
        )
        self.watch_restarts: Final = Counter(
            "controllerd_watch_restarts_total",
            "Times the etcd watch was re-established after an error.",
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
        self.audit_messages: Final = Counter(
            "controllerd_audit_messages_total",
            "Decision audit records by outcome: sent (acknowledged), dropped (buffer "
            "overflow or unconfirmed at shutdown), error (rejected permanently).",
            ["outcome"],
            registry=r,
        )

        for kind in KEY_KINDS:
            self.metadata_rejected.labels(kind=kind)
        for kind in OPERATOR_ERROR_KINDS:
            self.operator_errors.labels(kind=kind)
        for outcome in AUDIT_OUTCOMES:
            self.audit_messages.labels(outcome=outcome)
        for outcome in RELOAD_OUTCOMES:
            self.config_reloads.labels(outcome=outcome)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of the registry and its content type.

        Declared as text format 0.0.4, as prometheus_client's own exporter does
        by default: every Prometheus version parses it, and our names need none
        of the escaping that format 1.0.0 negotiates.
        """
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
