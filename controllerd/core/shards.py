"""Which shard a topic belongs to, and which live replica owns each shard (pure).

In sharded mode (``[election] mode = "sharded"``) topics map to a fixed number
of shards by a stable hash of ``tenant/namespace/topic``, and every replica
computes the owner of each shard from the same list of live members by
rendezvous (highest random weight) hashing: no coordinator, and when a member
joins or leaves only the shards whose highest-weight member changed move
(about ``1/N`` of them).

Both hashes are BLAKE2b of UTF-8 text, so they are the same on every machine,
Python version and process (unlike ``hash()``), and the reference broker can
check that a fencing key belongs to a topic's shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from hashlib import blake2b
from typing import Final

from controllerd.core.model import TopicName

DEFAULT_SHARDS: Final = 256
SHARD_KEY_DIGITS: Final = 4
"""Shard numbers in keys are zero-padded, so shard keys sort in shard order."""


def _h64(text: str) -> int:
    return int.from_bytes(blake2b(text.encode(), digest_size=8).digest(), "big")


def shard_of(topic: TopicName, shards: int) -> int:
    """The shard of ``topic``, in ``range(shards)``; stable across processes and versions."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return _h64(topic.path) % shards


def shard_name(shard: int) -> str:
    """The shard's key suffix, e.g. ``0017``."""
    return f"{shard:0{SHARD_KEY_DIGITS}d}"


def parse_shard_name(text: str) -> int | None:
    """The shard number of a key suffix written by :func:`shard_name`, else None."""
    if len(text) != SHARD_KEY_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def owner(shard: int, members: Iterable[str]) -> str | None:
    """The member with the highest rendezvous weight for ``shard`` (None: no members).

    Ties (equal 64-bit weights) go to the smaller member name, so the answer is
    a function of the set of members alone.
    """
    best: tuple[int, str] | None = None
    for member in members:
        weight = _h64(f"{shard}\x00{member}")
        if best is None or weight > best[0] or (weight == best[0] and member < best[1]):
            best = (weight, member)
    return None if best is None else best[1]


def assignment(shards: int, members: Iterable[str]) -> dict[int, str]:
    """Owner of every shard for this set of members (empty when there are none)."""
    live = sorted(set(members))
    if not live:
        return {}
    return {s: owner_name for s in range(shards) if (owner_name := owner(s, live)) is not None}


def moved(before: Mapping[int, str], after: Mapping[int, str]) -> set[int]:
    """Shards whose owner differs between two assignments."""
    return {s for s in before.keys() | after.keys() if before.get(s) != after.get(s)}
