"""``controllerd status``: who leads the cluster (or owns each shard), read from etcd.

One short, bounded read of the election keys, done by a process that is not a
replica: the leader key ``<controller_root>/leader`` in single mode; in sharded
mode the members under ``<controller_root>/members/`` and the per-shard keys
``<controller_root>/shards/<nnnn>`` (:mod:`controllerd.core.shards`). Every
failure an operator can fix becomes an :class:`~controllerd.errors.OperatorError`
with its exit status: etcd unreachable is :data:`~controllerd.errors.EXIT_UNAVAILABLE`
(3), never the same status as "no leader" (1), which :func:`problem` reports.

The mapping :func:`read_status` returns is the ``-o json`` contract: ``cluster``,
``mode``, ``leader`` and ``fencing_token`` always (``leader`` is null when nobody
leads, and always in sharded mode); in sharded mode also ``shards``, ``members``,
``owned_shards``, ``unowned_shards`` and ``shard_owners``. Keys are only added.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio

from controllerd import config as config_mod
from controllerd.adapters.election import identity_name, parse_identity
from controllerd.adapters.secrets import read_secret
from controllerd.adapters.store import KeyValue, Store, StoreError, StoreUnavailable, open_store
from controllerd.core import shards as shards_mod
from controllerd.errors import EXIT_UNAVAILABLE, EXIT_USAGE, OperatorError

DEFAULT_TIMEOUT: Final = 3.0
"""Seconds ``status`` keeps retrying an etcd that does not answer: short, it is interactive."""

SINGLE: Final = "single"
SHARDED: Final = "sharded"


def election_mode(cfg: config_mod.Config) -> tuple[str, int]:
    """``[election] mode`` and ``shards``, with the defaults of configs that predate them."""
    election = cfg.election
    mode = str(getattr(election, "mode", SINGLE))
    shards = int(getattr(election, "shards", shards_mod.DEFAULT_SHARDS))
    return mode, shards


async def read_status(cfg: config_mod.Config, *, within: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """The cluster's election state, read once from etcd within about ``2 * within`` s.

    ``within`` bounds how long an etcd that does not answer is retried.

    Raises:
        OperatorError: etcd unreachable or refusing our credentials
            (:data:`~controllerd.errors.EXIT_UNAVAILABLE`), or endpoints that
            cannot be used (:data:`~controllerd.errors.EXIT_USAGE`).
    """
    etcd = cfg.etcd
    endpoints = ", ".join(etcd.endpoints)
    try:
        with anyio.fail_after(2 * within + 1):
            async with open_store(
                etcd.endpoints,
                username=etcd.username,
                password=read_secret(etcd.password_file, "etcd.password_file"),
                ca_file=etcd.ca_file,
                cert_file=etcd.cert_file,
                key_file=etcd.key_file,
                timeout=min(etcd.timeout_seconds, within),
                retry_for=within,
            ) as store:
                return await _read(store, cfg)
    except (StoreUnavailable, TimeoutError) as exc:
        raise OperatorError(
            f"etcd at {endpoints} did not answer within {within:g}s (last error: "
            f"{_first_line(exc)})",
            exit_code=EXIT_UNAVAILABLE,
            setting="etcd.endpoints",
        ) from None
    except StoreError as exc:
        setting = "etcd.password_file" if etcd.username else "etcd.username"
        raise OperatorError(
            f"etcd at {endpoints} refused the request: {_first_line(exc)}",
            exit_code=EXIT_UNAVAILABLE,
            setting=setting,
        ) from None
    except ValueError as exc:  # open_store's endpoint and credential rules
        raise OperatorError(
            f"cannot use etcd endpoints {endpoints}: {exc}",
            exit_code=EXIT_USAGE,
            setting="etcd.endpoints",
        ) from None


def _first_line(exc: BaseException) -> str:
    """The root cause of a store error in a few words (grpc's own text is long)."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    details = getattr(root, "details", None)
    text = details() if callable(details) else str(root)
    text = " ".join(str(text or type(root).__name__).split())
    # grpc: "connections to all backends failing; last error: UNKNOWN: ipv4:h:p: why"
    last = re.search(r"last error: (?:[A-Z_]+: )?(?:ipv[46]:\S+: |dns:\S+: )?(.*?)\)?$", text)
    return last[1] if last else text


async def _read(store: Store, cfg: config_mod.Config) -> dict[str, Any]:
    mode, shard_count = election_mode(cfg)
    root = cfg.controller_root
    status: dict[str, Any] = {
        "cluster": cfg.cluster.name,
        "mode": mode,
        "leader": None,
        "fencing_token": None,
    }
    if mode != SHARDED:
        kv = await store.get(f"{root}/leader")
        if kv is not None:
            status["leader"] = parse_identity(kv.value)
            status["fencing_token"] = kv.create_revision
        return status
    members, _ = await store.get_prefix(f"{root}/members/")
    shard_keys, _ = await store.get_prefix(f"{root}/shards/")
    status.update(sharded_view(root, shard_count, members, shard_keys))
    return status


def sharded_view(
    root: str, shard_count: int, members: Sequence[KeyValue], shard_keys: Sequence[KeyValue]
) -> dict[str, Any]:
    """Ownership of every shard from the raw keys: pure, so it is tested without etcd."""
    owners: dict[str, dict[str, Any]] = {}
    for kv in shard_keys:
        shard = shards_mod.parse_shard_name(kv.key.removeprefix(f"{root}/shards/"))
        if shard is None or shard >= shard_count:
            continue
        identity = parse_identity(kv.value)
        owners[shards_mod.shard_name(shard)] = {
            "owner": identity_name(identity, "?"),
            "fencing_token": kv.create_revision,
        }
    owned_by: dict[str, int] = {}
    for entry in owners.values():
        owned_by[entry["owner"]] = owned_by.get(entry["owner"], 0) + 1
    member_rows = []
    for kv in members:
        name = kv.key.removeprefix(f"{root}/members/")
        identity = parse_identity(kv.value)
        member_rows.append({**identity, "member": name, "shards_owned": owned_by.get(name, 0)})
    member_rows.sort(key=lambda row: str(row["member"]))
    unowned = [s for s in range(shard_count) if shards_mod.shard_name(s) not in owners]
    return {
        "shards": shard_count,
        "members": member_rows,
        "owned_shards": len(owners),
        "unowned_shards": unowned,
        "shard_owners": dict(sorted(owners.items())),
    }


def problem(status: Mapping[str, Any], cfg: config_mod.Config) -> str | None:
    """Why ``status`` must exit 1 (nobody leads, or some shard has no owner), else None."""
    if status.get("mode") == SHARDED:
        unowned = status.get("unowned_shards") or []
        if not status.get("members"):
            return (
                f"cluster {cfg.cluster.name!r} has no live members "
                f"(nothing under {cfg.controller_root}/members/): no replica is running"
            )
        if unowned:
            return (
                f"cluster {cfg.cluster.name!r}: {len(unowned)} of {status['shards']} shards "
                f"have no owner (first: {shards_mod.shard_name(unowned[0])})"
            )
        return None
    if status.get("leader") is None:
        return (
            f"cluster {cfg.cluster.name!r} has no leader "
            f"(key {cfg.controller_root}/leader is absent): no replica is running, "
            "or a new leader is being elected"
        )
    return None


def _shown(value: object) -> str:
    """``value`` as text safe for a terminal: it comes from etcd, where anyone with write
    access may have put escape sequences; a character that does not print is escaped."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def render_table(status: Mapping[str, Any]) -> str:
    """The human form of :func:`read_status` (``-o table``)."""
    rows: list[tuple[str, str]] = [
        ("cluster", str(status["cluster"])),
        ("mode", str(status["mode"])),
    ]
    if status["mode"] != SHARDED:
        leader = status.get("leader")
        if leader is None:
            rows.append(("leader", "none"))
        else:
            where = ", ".join(
                f"{k} {_shown(leader[k])}" for k in ("host", "pid") if leader.get(k) is not None
            )
            name = _shown(identity_name(leader, "?"))
            rows.append(("leader", f"{name} ({where})" if where else name))
            rows.append(("fencing token", str(status["fencing_token"])))
        return _aligned(rows)
    unowned = status["unowned_shards"]
    rows.append(("shards", f"{status['owned_shards']} of {status['shards']} owned"))
    if unowned:
        shown = ", ".join(shards_mod.shard_name(s) for s in unowned[:8])
        rows.append(("unowned", shown + (", ..." if len(unowned) > 8 else "")))
    text = _aligned(rows)
    table = [("MEMBER", "SHARDS", "HOST", "PID")]
    for member in status["members"]:
        table.append(
            (
                _shown(member["member"]),
                str(member["shards_owned"]),
                _shown(member.get("host", "")),
                _shown(member.get("pid", "")),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    return text + "\n\n" + "\n".join(lines)


def _aligned(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
