"""When a load reporter writes a segment's load record (DESIGN §4), pure.

Pulsar's materiality gate writes only when a rate moved more than
``rate_change_threshold`` relative to the last *written* value, or crossed
to/from zero. Because the gate is anchored at the last write, a segment can sit
up to 25% above a split threshold indefinitely without a write (DESIGN §8.2);
with ``threshold_crossing`` a rate crossing any split or merge threshold, in
either direction, is also a write. ``heartbeat`` re-publishes an unchanged record
every ``max_interval`` so that a dead reporter's records go stale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controllerd.core.model import Rates


class WriteReason(enum.StrEnum):
    FIRST = "first"
    ZERO_CROSSING = "zero-crossing"
    MATERIAL_CHANGE = "material-change"
    THRESHOLD_CROSSING = "threshold-crossing"
    HEARTBEAT = "heartbeat"


@dataclass(frozen=True, slots=True)
class ReportRule:
    """The reporter's settings (``[load_report]``) and the policy's thresholds."""

    split_thresholds: Rates
    merge_thresholds: Rates
    rate_change_threshold: float = 0.25
    #: re-publish an unchanged record this often (seconds); 0 = never (Pulsar).
    max_interval_seconds: float = 300.0
    threshold_crossing: bool = True


def should_write(
    rule: ReportRule,
    last_written: Rates | None,
    current: Rates,
    now_ms: int,
    last_written_at_ms: int | None = None,
) -> WriteReason | None:
    """Why ``current`` must be written now, or None to keep the stored record.

    ``last_written`` is the last value written (seeded from the store on a
    cache miss; None = nothing stored). A bit-identical value is never
    rewritten, except as a heartbeat. A heartbeat only bumps ``sampledAtMs``:
    the caller keeps ``changedAtMs``.
    """
    if last_written is None:
        return WriteReason.FIRST
    if current != last_written:
        old, new = last_written.as_tuple(), current.as_tuple()
        if any((o == 0.0) != (n == 0.0) for o, n in zip(old, new, strict=True)):
            return WriteReason.ZERO_CROSSING
        limit = rule.rate_change_threshold
        if any(abs(n - o) > limit * abs(o) for o, n in zip(old, new, strict=True) if o != 0.0):
            return WriteReason.MATERIAL_CHANGE
        if rule.threshold_crossing and _crosses(rule, old, new):
            return WriteReason.THRESHOLD_CROSSING
    if (
        rule.max_interval_seconds > 0
        and last_written_at_ms is not None
        and now_ms - last_written_at_ms >= rule.max_interval_seconds * 1000.0
    ):
        return WriteReason.HEARTBEAT
    return None


def _crosses(rule: ReportRule, old: tuple[float, ...], new: tuple[float, ...]) -> bool:
    """A rate moved across a split threshold (``> T``) or a merge threshold (``< T``)."""
    for o, n, split, merge in zip(
        old, new, rule.split_thresholds.as_tuple(), rule.merge_thresholds.as_tuple(), strict=True
    ):
        if (o > split) != (n > split) or (o < merge) != (n < merge):
            return True
    return False
