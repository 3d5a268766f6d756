"""Topic -> shard and shard -> owner: stable, balanced, and minimal on membership change."""

from __future__ import annotations

import collections

from hypothesis import given
from hypothesis import strategies as st

from controllerd.core.model import TopicName
from controllerd.core.shards import (
    DEFAULT_SHARDS,
    assignment,
    moved,
    owner,
    parse_shard_name,
    shard_name,
    shard_of,
)


def test_shard_of_is_stable_across_processes() -> None:
    # Pinned values: a change here would move every topic to another shard on upgrade.
    assert shard_of(TopicName("acme", "ns", "orders"), DEFAULT_SHARDS) == 46
    pinned = [206, 203, 248, 249, 150]
    assert [shard_of(TopicName("t", "n", f"topic-{i}"), 256) for i in range(5)] == pinned


def test_topics_spread_evenly_over_shards() -> None:
    counts = collections.Counter(
        shard_of(TopicName("t", "n", f"topic-{i}"), 16) for i in range(16_000)
    )
    assert set(counts) == set(range(16))
    assert max(counts.values()) < 1.15 * 1000 and min(counts.values()) > 0.85 * 1000


def test_shard_names_round_trip_and_sort_in_order() -> None:
    names = [shard_name(s) for s in range(300)]
    assert names == sorted(names)
    assert [parse_shard_name(n) for n in names] == list(range(300))
    assert parse_shard_name("17") is None
    assert parse_shard_name("\uff10\uff10\uff11\uff17") is None  # fullwidth digits


def test_every_member_gets_about_its_share() -> None:
    owners = collections.Counter(assignment(256, ["a", "b", "c"]).values())
    assert set(owners) == {"a", "b", "c"}
    assert all(60 <= n <= 110 for n in owners.values())


@given(st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=6), st.text(min_size=1))
def test_a_join_moves_only_shards_to_the_newcomer(members: set[str], newcomer: str) -> None:
    before = assignment(64, members)
    after = assignment(64, members | {newcomer})
    for shard in moved(before, after):
        assert after[shard] == newcomer


@given(st.sets(st.text(min_size=1, max_size=8), min_size=2, max_size=6))
def test_a_leave_moves_only_the_leavers_shards(members: set[str]) -> None:
    leaver = sorted(members)[0]
    before = assignment(64, members)
    after = assignment(64, members - {leaver})
    assert moved(before, after) == {s for s, m in before.items() if m == leaver}


def test_no_members_no_owner() -> None:
    assert owner(3, []) is None and assignment(8, []) == {}
