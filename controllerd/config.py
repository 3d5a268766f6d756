"""The daemon's configuration: one TOML file plus ``CONTROLLERD_*`` environment overrides.

Pure: :func:`load` turns text and an env mapping into a validated, immutable
:class:`Config`, or raises one :class:`ConfigError` listing every problem. The TOML
shape, the env variable names and :func:`to_dict` are all derived from the dataclass
fields below, so a new field is automatically a setting. Fields marked
``metadata={"reload": False}`` are read only at start-up; :func:`restart_required` tells
the SIGHUP handler which changes it cannot apply, and :func:`reloaded` leaves them out.
Constructing a ``Config`` directly does not validate it; only :func:`load` guarantees a
valid one.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
import types
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Union, get_args, get_origin, get_type_hints

from controllerd.core.model import PolicySettings
from controllerd.errors import first_line
from controllerd.files import read_regular

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

ENV_PREFIX: Final = "CONTROLLERD_"
"""Prefix of override variables: ``CONTROLLERD_<TABLE>__<KEY>`` (levels split by ``__``)."""

CONFIG_PATH_ENV: Final = "CONTROLLERD_CONFIG"
"""Names the config file (read by the CLI); never treated as an override."""

_RESTART: Final = {"reload": False}
"""Field metadata: the value is only read at start-up, a change needs a restart."""

_HTTP_SCHEMES: Final = ("http://", "https://")
BROKER_PROFILES: Final = ("pulsar", "reference")
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMATS: Final = ("auto", "json", "console")


class ConfigError(ValueError):
    """The configuration is unusable; ``errors`` holds every problem as ``section.key: why``."""

    errors: list[str]

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors))
        self.errors = errors


# --- rule helpers (each returns the error messages it found) -----------------


def _show(value: object) -> str:
    """``-1`` rather than ``-1.0`` for whole floats, so messages echo what the user wrote."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(value)


def is_bootstrap_server(text: str) -> bool:
    """A Kafka bootstrap server as aiokafka takes it: ``host``, ``host:port``, ``[v6]`` or
    ``[v6]:port``, the port in 1..65535 (9092 when left out)."""
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
        if not (host and bracket) or (rest and not rest.startswith(":")):
            return False
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            host, port = text, ""
    if not host or any(c.isspace() for c in host):
        return False
    return not port or (port.isascii() and port.isdigit() and 0 < int(port) <= 65535)


_KAFKA_TOPIC: Final = re.compile(r"[A-Za-z0-9._-]{1,249}")
"""Kafka's legal topic names (``Topic.validate`` in Kafka's clients)."""

ETCD_MAX_LEASE_TTL: Final = 9_000_000_000
"""etcd refuses a longer lease (``MaxLeaseTTL`` in etcd's lessor): the grant would fail forever."""


def _positive(prefix: str, name: str, value: float, *, finite: bool = True) -> list[str]:
    if not value > 0:
        return [f"{prefix}.{name}: must be > 0 (got {_show(value)})"]
    if finite and not math.isfinite(value):
        return [f"{prefix}.{name}: must be finite (got {_show(value)})"]
    return []


#: Longest request timeout accepted: longer is a hang, not a timeout, and grpc turns
#: a deadline past ~1e9 s into an immediate DEADLINE_EXCEEDED on every etcd call.
MAX_REQUEST_TIMEOUT: Final = 3600.0


def _request_timeout(prefix: str, name: str, value: float) -> list[str]:
    errs = _positive(prefix, name, value)
    if not errs and value > MAX_REQUEST_TIMEOUT:
        errs.append(
            f"{prefix}.{name}: must be <= {MAX_REQUEST_TIMEOUT:g} (got {_show(value)}; "
            "a request that long is a hang)"
        )
    return errs


def _at_least(prefix: str, name: str, value: float, low: float) -> list[str]:
    if not value >= low:
        return [f"{prefix}.{name}: must be >= {_show(low)} (got {_show(value)})"]
    if not math.isfinite(value):
        return [f"{prefix}.{name}: must be finite (got {_show(value)})"]
    return []


def _one_of(prefix: str, name: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    if value in allowed:
        return []
    return [f"{prefix}.{name}: must be one of {', '.join(allowed)} (got {value!r})"]


def _http_url(prefix: str, name: str, value: str) -> list[str]:
    """An http(s) URL with a host, a valid port if any, and no blanks."""
    import urllib.parse

    if any(value.startswith(s) and len(value) > len(s) for s in _HTTP_SCHEMES):
        try:
            parts = urllib.parse.urlsplit(value)
            port_ok = parts.port is None or parts.port > 0  # .port raises out of 0-65535
        except ValueError as exc:
            return [f"{prefix}.{name}: {exc} (got {value!r})"]
        if parts.hostname and port_ok and not any(c.isspace() for c in value):
            return []
        return [f"{prefix}.{name}: must be http(s)://host[:port] (got {value!r})"]
    return [f"{prefix}.{name}: must be an http:// or https:// URL (got {value!r})"]


def header_safe(text: str) -> bool:
    """Printable ASCII: what an HTTP header value (the fencing key) can carry as is.
    httpx refuses anything else when it builds the request, so a cluster named
    ``prod-é`` failed every broker call (and GC's pending deletes exited 70)."""
    return all(" " <= c <= "~" for c in text)


def _key_path(prefix: str, name: str, value: str) -> list[str]:
    """An etcd key prefix: empty (the root) or ``/a/b`` without a trailing slash."""
    if value == "" or (value.startswith("/") and not value.endswith("/")):
        return []
    return [
        f"{prefix}.{name}: must be empty or start with '/' and not end with '/' (got {value!r})"
    ]


def _cert_pair(prefix: str, cert: str | None, key: str | None) -> list[str]:
    if (cert is None) == (key is None):
        return []
    missing = "key_file" if key is None else "cert_file"
    other = "cert_file" if key is None else "key_file"
    return [f"{prefix}.{missing}: must be set when {other} is (client TLS needs both)"]


def split_listen(listen: str) -> tuple[str, int] | None:
    """``host:port`` → (host, port); IPv6 hosts are bracketed. None when malformed."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not port.isascii():
        return None
    if host.startswith("[") and host.endswith("]") and len(host) > 2:
        host = host[1:-1]
    elif ":" in host or "[" in host or "]" in host:
        return None
    number = int(port)
    return (host, number) if number <= 65535 else None


# --- the tables ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    #: Names this Pulsar cluster; part of the controller's etcd root, so two
    #: clusters sharing one etcd do not elect one leader between them.
    name: str = field(default="default", metadata=_RESTART)

    def errors(self, prefix: str = "cluster") -> list[str]:
        if self.name and "/" not in self.name and header_safe(self.name):
            return []
        return [
            f"{prefix}.name: must be non-empty printable ASCII without '/' "
            f"(got {self.name!r}; the leader key it names goes in an HTTP header)"
        ]


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """Connection to the etcd holding Pulsar's metadata. Only read at start-up."""

    #: etcd client URLs; the default is a local single-node etcd.
    endpoints: tuple[str, ...] = field(default=("http://127.0.0.1:2379",), metadata=_RESTART)
    #: Key prefix of the brokers' metadata; unset = by ``broker.profile``: "" (the etcd
    #: root) for Pulsar, whose etcd store writes its paths at the root (pulsar-compat
    #: 1.1), and "/pulsar" for the reference broker.
    metadata_prefix: str | None = field(default=None, metadata=_RESTART)
    #: Our own keys (election, state) live under ``<controller_prefix>/<cluster.name>``.
    controller_prefix: str = field(default="/controllerd", metadata=_RESTART)
    #: etcd user; None = no authentication (etcd's default).
    username: str | None = field(default=None, metadata=_RESTART)
    #: File holding the etcd password, so the secret stays out of this file.
    password_file: str | None = field(default=None, metadata=_RESTART)
    #: PEM CA bundle for https endpoints; None = the system trust store.
    ca_file: str | None = field(default=None, metadata=_RESTART)
    #: PEM client certificate for mutual TLS; needs key_file.
    cert_file: str | None = field(default=None, metadata=_RESTART)
    #: PEM private key of cert_file.
    key_file: str | None = field(default=None, metadata=_RESTART)
    #: Seconds per etcd request; 5 s tolerates an etcd leader election.
    timeout_seconds: float = field(default=5.0, metadata=_RESTART)

    def errors(self, prefix: str = "etcd") -> list[str]:
        errs: list[str] = []
        if not self.endpoints:
            errs.append(f"{prefix}.endpoints: must list at least one URL")
        for i, url in enumerate(self.endpoints):
            errs += _http_url(prefix, f"endpoints[{i}]", url)
        if self.metadata_prefix is not None:
            errs += _key_path(prefix, "metadata_prefix", self.metadata_prefix)
        errs += _key_path(prefix, "controller_prefix", self.controller_prefix)
        if not header_safe(self.controller_prefix):
            errs.append(
                f"{prefix}.controller_prefix: must be printable ASCII (got "
                f"{self.controller_prefix!r}; the leader key under it goes in an HTTP header)"
            )
        errs += _cert_pair(prefix, self.cert_file, self.key_file)
        errs += _request_timeout(prefix, "timeout_seconds", self.timeout_seconds)
        return errs


ELECTION_MODES: Final = ("single", "sharded")


@dataclass(frozen=True, slots=True)
class ElectionSettings:
    #: Seconds (etcd leases are whole seconds). A dead leader is replaced within
    #: this; 10 s rides out GC pauses without a long leaderless gap.
    lease_ttl_seconds: int = field(default=10, metadata=_RESTART)
    #: "single": one replica leads every topic, the others stand by with a warm view.
    #: "sharded": topics are spread over every live replica by shard, each shard
    #: fenced on its own key.
    mode: str = field(default="single", metadata=_RESTART)
    #: Shards in sharded mode; fixed for the life of a cluster (a topic's shard is a
    #: hash of its name modulo this), so every replica must agree on it.
    shards: int = field(default=256, metadata=_RESTART)

    def errors(self, prefix: str = "election") -> list[str]:
        # The lease is refreshed at ttl/3; below 2 s that interval is too short.
        errs = _at_least(prefix, "lease_ttl_seconds", self.lease_ttl_seconds, 2)
        if not errs and self.lease_ttl_seconds > ETCD_MAX_LEASE_TTL:
            errs.append(
                f"{prefix}.lease_ttl_seconds: must be at most {ETCD_MAX_LEASE_TTL} "
                f"(etcd's limit; got {self.lease_ttl_seconds})"
            )
        errs += _one_of(prefix, "mode", self.mode, ELECTION_MODES)
        if not 1 <= self.shards <= 9999:
            errs.append(f"{prefix}.shards: must be between 1 and 9999 (got {self.shards})")
        return errs


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    #: Seconds between split/merge evaluations; 60 s matches Pulsar's load-report
    #: cadence, so evaluating faster sees no new data.
    interval_seconds: float = 60.0
    #: Seconds a consumer (un)registration waits for more before the topic is
    #: evaluated, so a group starting N consumers gets one N-way split, not a
    #: 2-way split and a cooldown. 0 evaluates at once.
    consumer_settle_seconds: float = 0.05

    def errors(self, prefix: str = "autoscale") -> list[str]:
        return _positive(prefix, "interval_seconds", self.interval_seconds) + _at_least(
            prefix, "consumer_settle_seconds", self.consumer_settle_seconds, 0.0
        )


@dataclass(frozen=True, slots=True)
class GcSettings:
    #: Whether controllerd collects sealed segments; unset = by ``broker.profile``:
    #: on for the reference broker, off for Pulsar, whose own sealed-segment GC runs
    #: whatever its auto-scaler setting (pulsar-compat 5.3) and owns retention.
    enabled: bool | None = None
    #: Seconds between garbage-collection passes over sealed segments.
    interval_seconds: float = 60.0
    #: Seconds a sealed segment is kept when its topic sets no retention; one day.
    #: Negative = keep forever.
    default_retention_seconds: float = 86_400.0

    def errors(self, prefix: str = "gc") -> list[str]:
        errs = _positive(prefix, "interval_seconds", self.interval_seconds)
        if not math.isfinite(self.default_retention_seconds):
            errs.append(
                f"{prefix}.default_retention_seconds: must be finite, negative to keep "
                f"forever (got {_show(self.default_retention_seconds)})"
            )
        return errs


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    #: Pulsar admin REST base URL; the default is a local standalone broker.
    admin_url: str = field(default="http://127.0.0.1:8080", metadata=_RESTART)
    #: Admin API dialect: "pulsar" (upstream) or "reference" (our test broker).
    profile: str = field(default="pulsar", metadata=_RESTART)
    #: File holding the admin bearer token; re-read on SIGHUP so tokens can rotate.
    token_file: str | None = None
    #: PEM CA bundle for an https admin_url; None = the system trust store.
    ca_file: str | None = field(default=None, metadata=_RESTART)
    #: PEM client certificate for mutual TLS; needs key_file.
    cert_file: str | None = field(default=None, metadata=_RESTART)
    #: PEM private key of cert_file.
    key_file: str | None = field(default=None, metadata=_RESTART)
    #: Seconds per admin request; splits touch metadata and can take a few seconds.
    timeout_seconds: float = field(default=10.0, metadata=_RESTART)
    #: Retries of a failed idempotent admin request (with backoff); 0 = no retry.
    max_retries: int = field(default=5, metadata=_RESTART)

    def errors(self, prefix: str = "broker") -> list[str]:
        return [
            *_http_url(prefix, "admin_url", self.admin_url),
            *_one_of(prefix, "profile", self.profile, BROKER_PROFILES),
            *_cert_pair(prefix, self.cert_file, self.key_file),
            *_request_timeout(prefix, "timeout_seconds", self.timeout_seconds),
            *_at_least(prefix, "max_retries", self.max_retries, 0),
        ]


@dataclass(frozen=True, slots=True)
class HttpSettings:
    #: ``host:port`` of /metrics and /status (IPv6 as ``[::1]:9464``); loopback by
    #: default because /status is unauthenticated, 9464 is the Prometheus exporter port.
    listen: str = field(default="127.0.0.1:9464", metadata=_RESTART)

    @property
    def host(self) -> str:
        """The listen host without IPv6 brackets. Requires a valid ``listen``."""
        return _listen_or_raise(self.listen)[0]

    @property
    def port(self) -> int:
        return _listen_or_raise(self.listen)[1]

    def errors(self, prefix: str = "http") -> list[str]:
        if split_listen(self.listen) is not None:
            return []
        return [f"{prefix}.listen: must be host:port with a port 0-65535 (got {self.listen!r})"]


def _listen_or_raise(listen: str) -> tuple[str, int]:
    parsed = split_listen(listen)
    if parsed is None:
        raise ValueError(f"http.listen: not host:port: {listen!r}")
    return parsed


@dataclass(frozen=True, slots=True)
class AuditSettings:
    #: Kafka bootstrap servers (``host:port,...``) for the decision audit log;
    #: None = decisions are only logged.
    kafka_bootstrap: str | None = field(default=None, metadata=_RESTART)
    #: Kafka topic receiving one record per decision.
    topic: str = field(default="controllerd.decisions", metadata=_RESTART)
    #: Records held while Kafka is unreachable before the oldest are dropped;
    #: bounded so an outage cannot exhaust memory.
    buffer_size: int = field(default=1000, metadata=_RESTART)

    def errors(self, prefix: str = "audit") -> list[str]:
        errs = _at_least(prefix, "buffer_size", self.buffer_size, 1)
        if not self.topic:
            errs.append(f"{prefix}.topic: must not be empty")
        elif not _KAFKA_TOPIC.fullmatch(self.topic) or self.topic in (".", ".."):
            errs.append(
                f"{prefix}.topic: a Kafka topic is 1-249 of a-z A-Z 0-9 . _ - (got {self.topic!r})"
            )
        servers = self.kafka_bootstrap.split(",") if self.kafka_bootstrap is not None else []
        if not all(is_bootstrap_server(s.strip()) for s in servers):
            errs.append(
                f"{prefix}.kafka_bootstrap: expected host[:port][,host[:port]...] "
                f"(got {self.kafka_bootstrap!r})"
            )
        return errs


@dataclass(frozen=True, slots=True)
class LoadReportSettings:
    #: Relative change (0.25 = 25 %) of any rate that makes a reporter re-publish
    #: its load record; smaller means more etcd writes. inf = never for a change.
    rate_change_threshold: float = 0.25
    #: Seconds after which an unchanged record is re-published anyway, keeping
    #: sampledAtMs fresh (well under policy.load_ttl_seconds). 0 = never.
    report_max_interval_seconds: float = 300.0
    #: Also write when a rate crosses a split or merge threshold, however small
    #: the change, so the policy never acts on the wrong side of one.
    threshold_crossing: bool = True

    def errors(self, prefix: str = "load_report") -> list[str]:
        return [
            *_positive(prefix, "rate_change_threshold", self.rate_change_threshold, finite=False),
            *_at_least(prefix, "report_max_interval_seconds", self.report_max_interval_seconds, 0),
        ]


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    #: Minimum level logged: debug, info, warning or error.
    level: str = "info"
    #: auto = console on a terminal, json otherwise (for log shippers).
    format: str = "auto"

    def errors(self, prefix: str = "logging") -> list[str]:
        return [
            *_one_of(prefix, "level", self.level, LOG_LEVELS),
            *_one_of(prefix, "format", self.format, LOG_FORMATS),
        ]


@dataclass(frozen=True, slots=True)
class Config:
    """The whole file; one field per TOML table. Defaults are the reference config."""

    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    election: ElectionSettings = field(default_factory=ElectionSettings)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)
    gc: GcSettings = field(default_factory=GcSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    audit: AuditSettings = field(default_factory=AuditSettings)
    load_report: LoadReportSettings = field(default_factory=LoadReportSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)

    @property
    def controller_root(self) -> str:
        """etcd prefix of our own keys: ``<etcd.controller_prefix>/<cluster.name>``."""
        return f"{self.etcd.controller_prefix}/{self.cluster.name}"

    @property
    def metadata_prefix(self) -> str:
        """Where the brokers' keys live: ``etcd.metadata_prefix``, else by profile."""
        if self.etcd.metadata_prefix is not None:
            return self.etcd.metadata_prefix
        return "" if self.broker.profile == "pulsar" else "/pulsar"

    @property
    def gc_enabled(self) -> bool:
        """Whether our GC runs: ``gc.enabled``, else on unless the broker is Pulsar."""
        if self.gc.enabled is not None:
            return self.gc.enabled
        return self.broker.profile != "pulsar"

    def errors(self) -> list[str]:
        """Every violated rule across all tables (empty = valid)."""
        errs: list[str] = []
        for f in fields(self):
            errs += getattr(self, f.name).errors(f.name)
        return errs


# --- TOML → dataclasses (generic, driven by the type hints) -----------------

_NONE_TYPE: Final = type(None)


class _Invalid:
    """Marks a value that failed conversion (its error is already recorded)."""


_INVALID: Final = _Invalid()


def _optional_arm(tp: Any) -> Any | None:
    """``X`` for ``X | None``, else None."""
    if get_origin(tp) in (types.UnionType, Union):
        args = [a for a in get_args(tp) if a is not _NONE_TYPE]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0]
    return None


def _describe(tp: Any) -> str:
    if tp is bool:
        return "a boolean (true or false)"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if (arm := _optional_arm(tp)) is not None:
        return _describe(arm)
    if get_origin(tp) is tuple:
        return "a list of " + _describe(get_args(tp)[0]).split(" ", 1)[1] + "s"
    if is_dataclass(tp):
        return "a table"
    raise TypeError(f"unsupported config field type {tp!r}")


def _got(value: object) -> str:
    return "a table" if isinstance(value, dict) else repr(value)


def _convert(value: object, tp: Any, default: Any, path: str, errs: list[str]) -> Any:
    """``value`` (parsed TOML) as type ``tp``, or ``_INVALID`` after recording why not.

    A table is applied on top of ``default``: keys it omits keep their default.
    """
    if (arm := _optional_arm(tp)) is not None:
        # TOML has no null: an empty string unsets an optional setting (handy from env).
        return None if value == "" else _convert(value, arm, default, path, errs)
    if is_dataclass(tp):
        if isinstance(value, dict):
            return _build(default, value, path, errs)
    elif get_origin(tp) is tuple:
        elem, ellipsis = get_args(tp)
        if ellipsis is not Ellipsis:
            raise TypeError(f"only homogeneous tuples are supported, not {tp!r} at {path}")
        if isinstance(value, list):
            items = [_convert(v, elem, None, f"{path}[{i}]", errs) for i, v in enumerate(value)]
            return _INVALID if any(v is _INVALID for v in items) else tuple(items)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if -(2**63) <= value < 2**63:
                return value
            errs.append(f"{path}: an integer of {value.bit_length()} bits is out of range")
            return _INVALID
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if isinstance(value, float) or abs(value) < 2**1000:
                return float(value)  # a larger int cannot become a float
            errs.append(f"{path}: an integer of {value.bit_length()} bits is out of range")
            return _INVALID
    elif tp is str:
        if isinstance(value, str):
            try:
                value.encode("utf-8")  # an environment value that was not UTF-8 decodes
            except UnicodeEncodeError:  # to surrogates, which fail later, far from here
                errs.append(f"{path}: is not valid UTF-8 text")
                return _INVALID
            return value
    else:
        raise TypeError(f"unsupported config field type {tp!r} at {path}")
    errs.append(f"{path}: expected {_describe(tp)}, got {_got(value)}")
    return _INVALID


def _unknown(path: str, key: str, value: object, known: list[str]) -> str:
    what = "table" if isinstance(value, dict) else "setting"
    msg = f"{path}{key}: unknown {what}"
    close = difflib.get_close_matches(key, known, n=1)
    return f"{msg} (did you mean {close[0]}?)" if close else msg


def _build(base: Any, table: dict[str, Any], path: str, errs: list[str]) -> Any:
    """Dataclass instance ``base`` with the settings of a TOML table applied.

    Fields the table omits, or gives an unusable value, keep ``base``'s value.
    """
    hints = get_type_hints(type(base))
    names = [f.name for f in fields(base)]
    changes: dict[str, Any] = {}
    prefix = f"{path}." if path else ""
    for key, value in table.items():
        if key not in names:
            errs.append(_unknown(prefix, key, value, names))
            continue
        converted = _convert(value, hints[key], getattr(base, key), prefix + key, errs)
        if converted is not _INVALID:
            changes[key] = converted
    return replace(base, **changes)


# --- environment overrides -------------------------------------------------


def _env_value(raw: str, tp: Any) -> object:
    """A variable's value parsed as a TOML value; unparsable text is a plain string.

    A string field always takes the text (``CONTROLLERD_CLUSTER__NAME=123`` means "123"),
    unless it is a quoted TOML string.
    """
    try:
        parsed = tomllib.loads("v = " + raw)
    except (ValueError, RecursionError):  # as in load: then it is a plain string
        return raw
    if list(parsed) != ["v"]:  # e.g. "1\nx = 2" smuggling a second key
        return raw
    value = parsed["v"]
    if (tp is str or _optional_arm(tp) is str) and not isinstance(value, str):
        return raw
    return value


def _env_target(parts: list[str]) -> tuple[list[str], Any] | None:
    """The field path and type named by the lower-cased parts of a variable, if any."""
    cls: Any = Config
    tp: Any = Config
    for part in parts:
        if not is_dataclass(cls) or part not in {f.name for f in fields(cls)}:
            return None
        tp = get_type_hints(cls)[part]
        cls = tp
    return (parts, tp) if parts else None


def is_override(name: str) -> bool:
    """Whether an environment variable is a setting override.

    Only ``CONTROLLERD_<TABLE>__<KEY>`` is: every setting lives in a table, so
    the name has a ``__``. Other ``CONTROLLERD_*`` names, such as the
    ``CONTROLLERD_SERVICE_HOST`` that Kubernetes injects for a Service of that
    name, are not overrides and are ignored (the daemon logs them).
    """
    upper = name.upper()
    return upper.startswith(ENV_PREFIX) and upper != CONFIG_PATH_ENV and "__" in upper


def _apply_env(data: dict[str, Any], env: Mapping[str, str], errs: list[str]) -> dict[str, str]:
    """Merge overrides into ``data`` in place; returns dotted path → variable name."""
    sources: dict[str, str] = {}
    for name in sorted(env):
        upper = name.upper()
        if not is_override(upper):
            continue
        parts = upper[len(ENV_PREFIX) :].lower().split("__")
        target = _env_target(parts)
        if target is None:
            errs.append(f"{name}: unknown setting {'.'.join(parts)!r}")
            continue
        path, tp = target
        value = _env_value(env[name], tp)
        node: Any = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break  # the file has a non-table here: its type error is reported
            node = child
        else:
            _merge_value(node, path[-1], value)
            sources[".".join(path)] = name
    return sources


def _merge_value(table: dict[str, Any], key: str, value: object) -> None:
    """Set ``table[key]``; an inline table from env merges into the file's table."""
    old = table.get(key)
    table[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value


def _blame_env(errs: list[str], sources: Mapping[str, str]) -> list[str]:
    """Suffix errors about env-overridden settings with the variable, so users look there."""
    out = []
    for err in errs:
        subject = err.split(":", 1)[0]
        var = next((v for p, v in sources.items() if _within(subject, p)), None)
        out.append(err if var is None else f"{err} (from {var})")
    return out


def _within(subject: str, path: str) -> bool:
    """Whether the dotted ``subject`` is ``path`` or lies inside it."""
    return subject == path or subject.startswith((path + ".", path + "["))


def _subject(err: str) -> str:
    return err.split(":", 1)[0].split("[", 1)[0]


# --- public API ------------------------------------------------------------


def load(text: str, env: Mapping[str, str] | None = None) -> Config:
    """Parse, override from ``env`` (default: none) and validate; raises ConfigError.

    Validation runs even when some values had the wrong type (those keep their
    defaults), but a rule about a field that already has a type error is not reported.
    """
    try:
        # A byte-order mark (some Windows editors write one) is not TOML; skip it
        # rather than refuse "invalid statement (line 1, column 1)".
        data = tomllib.loads(text.removeprefix("\ufeff"))
    except (ValueError, RecursionError) as exc:
        # TOMLDecodeError is a ValueError; so is an integer of more than 4,300 digits,
        # and nesting thousands deep exhausts the parser's recursion.
        raise ConfigError([f"invalid TOML: {first_line(exc, 300)}"]) from None
    errs: list[str] = []
    sources = _apply_env(data, env or {}, errs)
    config: Config = _build(Config(), data, "", errs)
    bad_types = {_subject(e) for e in errs}
    errs += [e for e in config.errors() if not any(_within(_subject(e), b) for b in bad_types)]
    if errs:
        raise ConfigError(_blame_env(errs, sources))
    return config


#: A config path that means standard input (read once: keep the Config).
STDIN: Final = "-"


def read_text(path: str | os.PathLike[str]) -> str:
    """The config text at ``path`` (:data:`STDIN`: standard input); ConfigError, naming
    the file once, when it is unreadable, not UTF-8 or empty.

    An empty file (nothing but blanks and comments) is refused: it is almost
    always a truncated write or a failed template, and taken as valid it would
    silently reset every setting to its default on the next SIGHUP (issue #10).
    """
    import sys

    shown = "<stdin>" if str(path) == STDIN else str(path)
    try:
        raw = sys.stdin.buffer.read() if str(path) == STDIN else read_regular(path)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError([f"{shown}: cannot read config file: {reason}"]) from None
    if is_empty(text):
        raise ConfigError([f"{shown}: {EMPTY_FILE}"])
    return text


def load_file(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Config:
    """:func:`load` of :func:`read_text`; its errors are ConfigErrors too."""
    return load(read_text(path), env)


EMPTY_FILE: Final = (
    "config file is empty (no settings); refusing it rather than "
    "resetting every setting to its default"
)


def is_empty(text: str) -> bool:
    """Nothing but blanks and comments (see :func:`load_file`); a byte-order mark is blank."""
    return not any(
        line.strip() and not line.lstrip().startswith("#")
        for line in text.removeprefix("\ufeff").splitlines()
    )


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain(v) for f in fields(value) if (v := getattr(value, f.name)) is not None
        }
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def to_dict(config: Config) -> dict[str, Any]:
    """Nested plain dict in the TOML file's shape; unset (None) settings are omitted,
    as TOML has no null, so the result written as TOML loads back to ``config``."""
    result: dict[str, Any] = _plain(config)
    return result


def restart_required(old: Config, new: Config) -> list[str]:
    """Dotted names of changed ``reload=False`` fields: what a SIGHUP cannot apply."""
    changed: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if not f.metadata.get("reload", True):
                if va != vb:
                    changed.append(prefix + f.name)
            elif is_dataclass(va) and not isinstance(va, type):
                walk(va, vb, f"{prefix}{f.name}.")

    walk(old, new, "")
    return changed


def reloaded(old: Config, new: Config) -> Config:
    """The config a SIGHUP puts in force: ``new``'s reloadable settings, ``old``'s
    ``reload=False`` ones (the mirror image of :func:`restart_required`).

    Restart-only settings are read again after start-up too (e.g. the lease TTL at
    each new term), so the running config must keep their old values until a
    restart, not only say that they need one.
    """

    def merge(a: Any, b: Any) -> Any:
        changes: dict[str, Any] = {}
        for f in fields(a):
            va, vb = getattr(a, f.name), getattr(b, f.name)
            if not f.metadata.get("reload", True):
                changes[f.name] = va
            elif is_dataclass(va) and not isinstance(va, type):
                changes[f.name] = merge(va, vb)
        return replace(b, **changes)

    result: Config = merge(old, new)
    return result
