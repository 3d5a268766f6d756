"""The metric definitions: what /metrics exposes before anything happened.

Alerts and dashboards need every series of a closed label set to exist at 0
from the start (``increase()`` of an absent series is absent, not 0), no
``_created`` noise, names promtool accepts, and a line in docs/operations.md
for each metric.
"""

from __future__ import annotations

import math
import platform
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controllerd.daemon.metrics import (
    AUDIT_OUTCOMES,
    DECISION_REASONS,
    METADATA_KINDS,
    NOT_READY_REASONS,
    OPERATION_OPS,
    OPERATION_OUTCOMES,
    OPERATOR_ERROR_KINDS,
    RELOAD_OUTCOMES,
    Metrics,
)

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS_DOC = ROOT / "docs" / "operations.md"

#: Every metric 0.2 added (issue 15): the lead wires them into the daemon.
ADDED = {
    "controllerd_build_info",
    "controllerd_etcd_up",
    "controllerd_broker_up",
    "controllerd_metadata_rejected_total",
    "controllerd_ready",
    "controllerd_not_ready_reason",
    "controllerd_topic_retries_total",
    "controllerd_shards_owned",
    "controllerd_topics_owned",
    "controllerd_event_loop_lag_seconds",
    "controllerd_watch_lag_revisions",
    "controllerd_operator_errors_total",
    "controllerd_pulsar_autoscaler_topics",
}


def exposition(metrics: Metrics | None = None) -> str:
    body, content_type = (metrics or Metrics()).render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return body.decode()


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it is exposed with."""
    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def value(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and dict(sample.labels) == labels:
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not exposed")


def label_sets(text: str, name: str, label: str) -> set[str]:
    return {labels[label] for labels in samples(text).get(name, [])}


def test_closed_label_sets_are_exposed_at_zero_before_any_event() -> None:
    text = exposition()
    expected = {
        ("controllerd_audit_messages_total", "outcome"): set(AUDIT_OUTCOMES),
        ("controllerd_config_reloads_total", "outcome"): set(RELOAD_OUTCOMES),
        ("controllerd_metadata_rejected_total", "kind"): set(METADATA_KINDS),
        ("controllerd_operator_errors_total", "kind"): set(OPERATOR_ERROR_KINDS),
        ("controllerd_not_ready_reason", "reason"): set(NOT_READY_REASONS),
    }
    for (name, label), values in expected.items():
        assert label_sets(text, name, label) == values, name
    decisions = {
        (labels["action"], labels["reason"])
        for labels in samples(text)["controllerd_decisions_total"]
    }
    assert decisions == {(a, r) for a, rs in DECISION_REASONS.items() for r in rs}
    operations = {
        (labels["op"], labels["outcome"])
        for labels in samples(text)["controllerd_operations_total"]
    }
    assert operations == {(o, r) for o in OPERATION_OPS for r in OPERATION_OUTCOMES}
    assert value(text, "controllerd_decisions_total", action="split", reason="msgRateIn") == 0
    assert value(text, "controllerd_metadata_rejected_total", kind="cold_since") == 0


def test_no_created_series_and_build_info_names_the_build() -> None:
    text = exposition()
    assert not [name for name in samples(text) if name.endswith("_created")]
    assert samples(text)["controllerd_build_info"] == [
        {"version": metadata.version("controllerd"), "python": platform.python_version()}
    ]
    assert (
        value(
            text,
            "controllerd_build_info",
            version=metadata.version("controllerd"),
            python=platform.python_version(),
        )
        == 1
    )


def test_every_added_metric_is_exposed() -> None:
    names = set(samples(exposition()))
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}
    assert ADDED - (names | base) == set()


def test_readiness_is_one_hot_with_its_reason() -> None:
    metrics = Metrics()
    text = exposition(metrics)
    assert value(text, "controllerd_ready") == 0
    assert value(text, "controllerd_not_ready_reason", reason="starting") == 1
    metrics.set_readiness("etcd-unreachable")
    text = exposition(metrics)
    on = [r for r in NOT_READY_REASONS if value(text, "controllerd_not_ready_reason", reason=r)]
    assert on == ["etcd-unreachable"]
    metrics.set_readiness(None)
    text = exposition(metrics)
    assert value(text, "controllerd_ready") == 1
    assert not any(value(text, "controllerd_not_ready_reason", reason=r) for r in NOT_READY_REASONS)
    metrics.set_readiness("a reason nobody listed")
    assert value(exposition(metrics), "controllerd_not_ready_reason", reason="other") == 1


def test_broker_up_is_unknown_until_the_first_admin_request() -> None:
    """At 0 from the start, an idle leader (no topic to split, GC off: no request at
    all) fired ControllerdBrokerDown, whose rule reads == 0, on a healthy cluster."""
    assert math.isnan(value(exposition(Metrics()), "controllerd_broker_up"))


def test_promtool_accepts_the_exposition() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: install Debian's prometheus package (dev.sh does)"
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize(
    "name",
    sorted(
        {
            family.name
            for family in text_string_to_metric_families(exposition())
            if family.name.startswith("controllerd_")
        }
    ),
)
def test_every_metric_is_documented_for_operators(name: str) -> None:
    doc = OPERATIONS_DOC.read_text(encoding="utf-8")
    suffix = "_total" if f"{name}_total" in samples(exposition()) else ""
    assert f"`{name}{suffix}" in doc, f"{name}{suffix} has no row in docs/operations.md"
