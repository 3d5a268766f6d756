"""Layouts that tests of the core build alike."""

from __future__ import annotations

from controllerd.core.layout import initial_layout, merge, split
from controllerd.core.model import Layout


def split_merge_chain(generations: int) -> Layout:
    """One segment split in two and the two merged again, ``generations`` times: an
    ancestry ``2 * generations`` deep with ``generations`` merges, one active segment."""
    lay = initial_layout(1)
    for _ in range(generations):
        (last,) = [s.segment_id for s in lay.active_segments()]
        lay = split(lay, last, now_ms=0)
        a, b = sorted(s.segment_id for s in lay.active_segments())
        lay = merge(lay, a, b, now_ms=0)
    return lay
