"""Policy variants to compare, from one TOML file (pure).

Each ``[variants.<name>]`` table starts from a preset and overrides any field of
the daemon's config tables it names::

    [variants.pip483]
    preset = "pip483"             # Pulsar's defaults, binary splits, no extension
    [variants.controllerd]
    preset = "controllerd"        # our defaults, whatever the code says today
    [variants.static-8]
    static_segments = 8           # fixed provisioning (also: preset = "static-8")
    [variants.short-window]
    preset = "controllerd"
    policy.merge_window_seconds = 120
    [variants.window-grid]        # a grid: one variant per combination
    preset = "controllerd"
    grid."policy.merge_window_seconds" = [60, 120, 300]
    grid."load_report.threshold_crossing" = [true, false]

Overridable tables: ``policy`` (with ``split_thresholds`` / ``merge_thresholds``),
``load_report``, ``autoscale.interval_seconds``, ``gc.default_retention_seconds``
and ``simulator`` (``track_cold_since``, ``initial_segments``, ``hash_buckets``:
slices of the histogram reporters publish, 0 = none as Pulsar). Grid variants are
named ``<name>[<last key part>=<value>,...]``, in the grid's key order.

The ``controllerd`` preset reads ``PolicySettings()`` and ``LoadReportSettings()``
at call time, so it always backtests the defaults the daemon ships.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, get_type_hints

from controllerd.config import AutoscaleSettings, GcSettings, LoadReportSettings
from controllerd.core.model import PULSAR_PARITY, PolicySettings, Rates, shown
from controllerd.errors import first_line
from controllerd.pipeline.simulate import Strategy

PULSAR_POLICY: Final = PolicySettings(
    **{
        **PULSAR_PARITY,
        "enabled": True,
        "min_segments": 1,
        "max_segments": 64,
        "max_dag_depth": 10,
        "split_cooldown_seconds": 60.0,
        "merge_cooldown_seconds": 300.0,
        "merge_window_seconds": 300.0,
        "merge_backoff_decay_seconds": 86_400.0,
        "load_aware_splits": False,
        "split_thresholds": Rates(10_000.0, 50e6, 50_000.0, 250e6),
        "merge_thresholds": Rates(1_000.0, 5e6, 5_000.0, 25e6),
    }
)
"""PIP-483's defaults, spelled out so that changing ours never changes Pulsar's."""

PULSAR_REPORT: Final = LoadReportSettings(
    rate_change_threshold=0.25, report_max_interval_seconds=0.0, threshold_crossing=False
)
"""Pulsar's reporter: the 25% materiality gate only, no heartbeat, no threshold crossing."""

REFERENCE_THRESHOLDS: Final = PULSAR_POLICY.split_thresholds
"""Segment capacity in the metrics, and what ``--peak-over-threshold`` scales traces to."""

_T = TypeVar("_T")
_STATIC = re.compile(r"static-(\d+)")
_TABLES: Final = ("policy", "load_report", "autoscale", "gc", "simulator")
_NOT_VARIED: Final = ("grid", "description")
"""Keys of a variant that change no setting, so a grid over them repeats one variant."""
_REPLAYED: Final = {
    "autoscale": frozenset({"interval_seconds"}),
    "gc": frozenset({"default_retention_seconds"}),
}
"""The fields of these config tables a replay reads; any other would be silently ignored."""
_INT_LIMIT: Final = 2**63
"""An integer setting must fit a signed 64-bit long, as the daemon's config requires."""
_FLOAT_INT_LIMIT: Final = 2**1000
"""A larger integer is refused for a float setting, as by the daemon's config (one past
about 1.8e308 cannot become a float at all)."""


class VariantError(ValueError):
    """The variants file is unusable; ``errors`` names every bad key."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid variants:\n  " + "\n  ".join(errors))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    strategy: Strategy


def pip483() -> Strategy:
    return Strategy(
        PULSAR_POLICY,
        PULSAR_REPORT,
        interval_seconds=60.0,
        track_cold_since=False,
        gc_retention_seconds=86_400.0,
    )


def controllerd() -> Strategy:
    """The daemon's shipped defaults (read now, so they follow any change to them)."""
    return Strategy(
        PolicySettings(),
        LoadReportSettings(),
        interval_seconds=AutoscaleSettings().interval_seconds,
        track_cold_since=True,
        gc_retention_seconds=GcSettings().default_retention_seconds,
    )


def static(segments: int) -> Strategy:
    """Fixed provisioning: ``segments`` equal ranges, auto-scale off."""
    base = controllerd()
    return dataclasses.replace(
        base,
        policy=dataclasses.replace(base.policy, enabled=False),
        initial_segments=segments,
    )


def preset(name: str) -> Strategy:
    if name == "pip483":
        return pip483()
    if name == "controllerd":
        return controllerd()
    if (m := _STATIC.fullmatch(name)) is not None:
        return static(int(m.group(1)))
    raise KeyError(name)


def default_variants() -> list[Variant]:
    """What ``backtest`` compares when no file is given."""
    return [Variant(n, preset(n)) for n in ("pip483", "controllerd", "static-8")]


def parse_variants(text: str) -> list[Variant]:
    """Every variant of a variants file, grids expanded, in file order; raises VariantError."""
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        # As the daemon's config.load: TOMLDecodeError is a ValueError, so is an integer
        # of more than 4,300 digits, and nesting thousands deep exhausts the parser.
        raise VariantError([f"invalid TOML: {first_line(exc, 300)}"]) from None
    errs: list[str] = [f"{k}: unknown top-level key" for k in data if k != "variants"]
    tables = data.get("variants")
    if not isinstance(tables, dict) or not tables:
        raise VariantError([*errs, "variants: expected at least one [variants.<name>] table"])
    out: list[Variant] = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            errs.append(f"variants.{name}: expected a table")
            continue
        if not name.strip() or not name.isprintable():
            # the name is a column value in metrics.csv and a label in every plot
            errs.append(f"variants.{name!r}: a name must be printable and not blank")
            continue
        out.extend(_expand(name, table, errs))
    seen: set[str] = set()
    for v in out:
        if v.name in seen:
            errs.append(f"variants.{v.name}: defined twice")
        seen.add(v.name)
    if errs:
        raise VariantError(errs)
    return out


#: Largest variants or grid file read (a grid of thousands of variants is ~100 KiB):
#: past it the file is refused, rather than read for ever from a device (/dev/zero).
MAX_VARIANTS_BYTES: Final = 16 * 1024 * 1024


def load_variants(path: str | Path) -> list[Variant]:
    """:func:`parse_variants` of a file (or a pipe: ``<(...)`` works); every error starts
    with the file's name."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_VARIANTS_BYTES + 1)
    except OSError as exc:
        raise VariantError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    if len(raw) > MAX_VARIANTS_BYTES:
        raise VariantError(
            [f"{path}: larger than {MAX_VARIANTS_BYTES >> 20} MiB; not a variants file"]
        )
    try:
        text = raw.decode("utf-8-sig")  # an editor's BOM is no TOML error
    except UnicodeDecodeError as exc:
        raise VariantError([f"{path}: not UTF-8 text ({exc.reason})"]) from None
    try:
        return parse_variants(text)
    except VariantError as exc:
        raise VariantError([f"{path}: {err}" for err in exc.errors]) from None


def _expand(name: str, table: dict[str, Any], errs: list[str]) -> list[Variant]:
    where = f"variants.{name}"
    grid = table.get("grid", {})
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        errs.append(f"{where}.grid: expected a table of dotted keys to non-empty lists")
        return []
    flat = _flatten(grid)
    ignored = [k for k in flat if k.split(".", 1)[0] in _NOT_VARIED]
    if ignored:
        # _build would drop them, giving variants that differ in name only
        errs.extend(f'{where}.grid."{k}": not a setting a variant can vary' for k in ignored)
        return []
    if not flat:
        strategy = _build(where, table, errs)
        return [] if strategy is None else [Variant(name, strategy)]
    keys = list(flat)
    short = [k.rsplit(".", 1)[-1] for k in keys]
    labels = keys if len(set(short)) < len(short) else short
    out = []
    for combo in itertools.product(*(flat[k] for k in keys)):
        merged = {k: v for k, v in table.items() if k != "grid"}
        for key, value in zip(keys, combo, strict=True):
            _set_path(merged, key.split("."), value)
        label = ",".join(f"{lbl}={_show(v)}" for lbl, v in zip(labels, combo, strict=True))
        strategy = _build(f"{where}[{label}]", merged, errs)
        if strategy is not None:
            out.append(Variant(f"{name}[{label}]", strategy))
    return out


def _flatten(grid: Mapping[str, Any], prefix: str = "") -> dict[str, list[Any]]:
    """``grid."a.b" = [...]`` and ``[grid.a] b = [...]`` both give ``{"a.b": [...]}``."""
    out: dict[str, list[Any]] = {}
    for key, value in grid.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _set_path(table: dict[str, Any], path: list[str], value: Any) -> None:
    node = table
    for part in path[:-1]:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, dict) else {}
        node = child
    node[path[-1]] = value


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _build(where: str, table: Mapping[str, Any], errs: list[str]) -> Strategy | None:
    known = {"preset", "static_segments", "description", "grid", *_TABLES}
    errs.extend(f"{where}.{k}: unknown key" for k in table if k not in known)
    if not isinstance(table.get("description", ""), str):
        errs.append(f"{where}.description: expected a string, got {shown(table['description'])}")
    name = table.get("preset")
    count = table.get("static_segments")
    if count is not None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 65536:
            errs.append(
                f"{where}.static_segments: expected an integer 1..65536, got {shown(count)}"
            )
            return None
        if name is not None:
            errs.append(f"{where}: give preset or static_segments, not both")
            return None
        base = static(count)
    elif name is None:
        base = controllerd()
    else:
        try:
            base = preset(str(name))
        except KeyError:
            errs.append(
                f"{where}.preset: expected pip483, controllerd or static-N, got {shown(name)}"
            )
            return None
    before = len(errs)
    policy = _override(base.policy, table.get("policy", {}), f"{where}.policy", errs)
    report = _override(base.report, table.get("load_report", {}), f"{where}.load_report", errs)
    autoscale = _override(
        AutoscaleSettings(interval_seconds=base.interval_seconds),
        table.get("autoscale", {}),
        f"{where}.autoscale",
        errs,
        only=_REPLAYED["autoscale"],
    )
    gc = _override(
        GcSettings(default_retention_seconds=base.gc_retention_seconds),
        table.get("gc", {}),
        f"{where}.gc",
        errs,
        only=_REPLAYED["gc"],
    )
    sim = _override(
        _Simulator(base.track_cold_since, base.initial_segments, base.hash_buckets),
        table.get("simulator", {}),
        f"{where}.simulator",
        errs,
    )
    if len(errs) > before:
        return None
    strategy = Strategy(
        policy,
        report,
        interval_seconds=autoscale.interval_seconds,
        track_cold_since=sim.track_cold_since,
        initial_segments=sim.initial_segments,
        gc_retention_seconds=gc.default_retention_seconds,
        hash_buckets=sim.hash_buckets,
    )
    problems = strategy.errors()
    errs.extend(f"{where}.{p}" for p in problems)
    return None if problems else strategy


@dataclass(frozen=True, slots=True)
class _Simulator:
    track_cold_since: bool
    initial_segments: int
    hash_buckets: int = 0


def _override(
    base: _T, table: Any, where: str, errs: list[str], only: frozenset[str] | None = None
) -> _T:
    """``base`` (a dataclass) with the table's fields replaced, type-checked per field;
    ``only`` limits them to the fields the replay reads (others would be ignored)."""
    if not isinstance(table, dict):
        errs.append(f"{where}: expected a table")
        return base
    hints = get_type_hints(type(base))
    changes: dict[str, Any] = {}
    for key, value in table.items():
        if key not in hints or key.startswith("_") or (only is not None and key not in only):
            errs.append(f"{where}.{key}: unknown setting")
            continue
        current = getattr(base, key)
        tp = hints[key]
        if dataclasses.is_dataclass(current):
            changes[key] = _override(current, value, f"{where}.{key}", errs)
        elif tp is bool:
            if isinstance(value, bool):
                changes[key] = value
            else:
                errs.append(f"{where}.{key}: expected true or false, got {shown(value)}")
        elif tp is int:
            if isinstance(value, bool) or not isinstance(value, int):
                errs.append(f"{where}.{key}: expected an integer, got {shown(value)}")
            elif not -_INT_LIMIT <= value < _INT_LIMIT:  # the daemon's bound (config._convert)
                errs.append(_out_of_range(f"{where}.{key}", value))
            else:
                changes[key] = value
        elif tp is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                errs.append(f"{where}.{key}: expected a number, got {shown(value)}")
            elif isinstance(value, int) and not abs(value) < _FLOAT_INT_LIMIT:
                errs.append(_out_of_range(f"{where}.{key}", value))  # float() would overflow
            else:
                changes[key] = float(value)
        else:
            errs.append(f"{where}.{key}: cannot be varied")
    return dataclasses.replace(base, **changes)  # type: ignore[type-var]


def _out_of_range(setting: str, value: int) -> str:
    """The daemon config's message for an integer it refuses (4,000 digits are no message)."""
    return f"{setting}: an integer of {value.bit_length()} bits is out of range"
