"""The config contract: TOML keys, env overrides, validation messages, reload marks."""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Iterator
from dataclasses import Field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controllerd import config as cfg
from controllerd.config import (
    Config,
    ConfigError,
    is_empty,
    load,
    load_file,
    restart_required,
    to_dict,
)
from controllerd.core.model import PolicySettings, Rates

REFERENCE = Path(__file__).resolve().parent.parent / "config" / "controllerd.toml"


def leaf_fields(obj: Any = None, prefix: str = "") -> Iterator[tuple[str, Field[Any]]]:
    """(dotted name, field) of every non-table setting of the Config tree."""
    obj = Config() if obj is None else obj
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            yield from leaf_fields(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def errors_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load(text, env)
    return info.value.errors


# --- defaults and the reference file ----------------------------------------


def test_policy_defaults_are_pulsars_except_the_merge_window() -> None:
    policy = load("").policy
    assert policy.enabled is True
    assert (policy.min_segments, policy.max_segments, policy.max_dag_depth) == (1, 64, 10)
    assert (policy.split_cooldown_seconds, policy.merge_cooldown_seconds) == (60.0, 300.0)
    assert policy.merge_window_seconds == 7200.0  # Pulsar: 300; chosen by backtest
    assert policy.split_thresholds == Rates(10_000.0, 50e6, 50_000.0, 250e6)
    assert policy.merge_thresholds == Rates(1_000.0, 5e6, 5_000.0, 25e6)


def test_defaults_are_valid_and_complete() -> None:
    assert load("") == Config()
    assert Config().errors() == []
    assert Config().controller_root == "/controllerd/default"


def test_reference_file_loads_to_defaults() -> None:
    assert load_file(REFERENCE) == Config()


def _is_toml(line: str) -> bool:
    try:
        tomllib.loads(line)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _reference_keys() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Scan the reference file: (active key → line, commented-out key → line,
    any key → the comment block just above it)."""
    table = ""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    docs: dict[str, str] = {}
    block: list[str] = []
    for line in REFERENCE.read_text().splitlines():
        stripped = line.strip()
        if m := re.fullmatch(r"\[([a-z_.]+)\]", stripped):
            table, block = m[1], []
        elif (m := re.fullmatch(r"#\s*([a-z_]+)\s*=.*", stripped)) and _is_toml(stripped[1:]):
            commented[f"{table}.{m[1]}"] = line
            docs[f"{table}.{m[1]}"], block = " ".join(block), []
        elif stripped.startswith("#"):
            block.append(stripped)
        elif m := re.fullmatch(r"([a-z_]+)\s*=.*", stripped):
            active[f"{table}.{m[1]}"] = line
            docs[f"{table}.{m[1]}"], block = " ".join(block), []
        else:
            block = []
    return active, commented, docs


def test_reference_file_lists_every_field_and_only_real_ones() -> None:
    active, commented, _ = _reference_keys()
    names = {name for name, _ in leaf_fields()}
    assert names - active.keys() - commented.keys() == set(), "fields missing from the file"
    assert active.keys() - names == set(), "reference keys that are not settings"
    assert commented.keys() - names == set(), "commented-out keys that are not settings"

    # The line scan must agree with the real TOML parse of the active keys.
    def flatten(d: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for k, v in d.items():
            yield from flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]

    assert set(flatten(tomllib.loads(REFERENCE.read_text()))) == set(active)


def test_reference_file_states_reload_behaviour_of_each_key() -> None:
    _, _, docs = _reference_keys()
    reload_of = {name: f.metadata.get("reload", True) for name, f in leaf_fields()}
    assert docs.keys() == reload_of.keys()
    for name, comment in docs.items():
        expected = "Reloads on SIGHUP" if reload_of[name] else "Restart required"
        assert expected in comment, f"{name}: comment should say {expected!r}: {comment!r}"


def test_reference_file_commented_examples_are_valid() -> None:
    _, commented, _ = _reference_keys()
    text = REFERENCE.read_text()
    for line in commented.values():
        text = text.replace(line, line.lstrip().removeprefix("#").lstrip())
    config = load(text)
    assert config.broker.token_file == "/etc/controllerd/broker-token"
    assert all(getattr(config.etcd, k) is not None for k in ("username", "cert_file"))


# --- validation ---------------------------------------------------------------

RATES = ("msg_rate_in", "byte_rate_in", "msg_rate_out", "byte_rate_out")

INVALID = [
    ("[policy]\nmin_segments = 0", "policy.min_segments"),
    ("[policy]\nmin_segments = 10\nmax_segments = 5", "policy.max_segments"),
    ("[policy]\nmax_dag_depth = -1", "policy.max_dag_depth"),
    ("[policy]\nsplit_cooldown_seconds = -1", "policy.split_cooldown_seconds"),
    ("[policy]\nmerge_cooldown_seconds = -0.5", "policy.merge_cooldown_seconds"),
    ("[policy]\nmerge_window_seconds = -1", "policy.merge_window_seconds"),
    ("[policy]\nload_ttl_seconds = -1", "policy.load_ttl_seconds"),
    ("[policy]\nmerge_window_seconds = inf", "policy.merge_window_seconds"),
    ("[policy.split_thresholds]\nmsg_rate_in = 0", "policy.split_thresholds.msg_rate_in"),
    ("[policy.merge_thresholds]\nbyte_rate_out = -1", "policy.merge_thresholds.byte_rate_out"),
    *[
        (
            f"[policy.merge_thresholds]\n{r} = {getattr(PolicySettings().split_thresholds, r)}",
            f"policy.split_thresholds.{r}",
        )
        for r in RATES
    ],
    ("[policy]\nmax_split_fanout = 1", "policy.max_split_fanout"),
    ("[policy]\nmin_split_width = 0", "policy.min_split_width"),
    ("[policy]\nmerge_combined_max_ratio = 0", "policy.merge_combined_max_ratio"),
    ('[broker]\nprofile = "kafka"', "broker.profile"),
    ('[broker]\nadmin_url = "ftp://x"', "broker.admin_url"),
    ('[broker]\nadmin_url = "http://"', "broker.admin_url"),
    ("[broker]\ntimeout_seconds = -1", "broker.timeout_seconds"),
    ("[broker]\ntimeout_seconds = inf", "broker.timeout_seconds"),
    ("[broker]\nmax_retries = -1", "broker.max_retries"),
    ('[broker]\ncert_file = "/c.pem"', "broker.key_file"),
    ("[election]\nlease_ttl_seconds = 1", "election.lease_ttl_seconds"),
    ("[autoscale]\ninterval_seconds = 0", "autoscale.interval_seconds"),
    ("[autoscale]\ninterval_seconds = nan", "autoscale.interval_seconds"),
    ("[gc]\ninterval_seconds = 0", "gc.interval_seconds"),
    ("[gc]\ndefault_retention_seconds = inf", "gc.default_retention_seconds"),
    ('[http]\nlisten = "nope"', "http.listen"),
    ('[http]\nlisten = "127.0.0.1:65536"', "http.listen"),
    ('[http]\nlisten = ":9464"', "http.listen"),
    ('[http]\nlisten = "::1:9464"', "http.listen"),
    ('[http]\nlisten = "host:-1"', "http.listen"),
    ("[audit]\nbuffer_size = 0", "audit.buffer_size"),
    ('[audit]\ntopic = ""', "audit.topic"),
    ("[load_report]\nrate_change_threshold = 0", "load_report.rate_change_threshold"),
    ("[load_report]\nreport_max_interval_seconds = -1", "load_report.report_max_interval_seconds"),
    ('[logging]\nlevel = "verbose"', "logging.level"),
    ('[logging]\nformat = "xml"', "logging.format"),
    ('[cluster]\nname = ""', "cluster.name"),
    ('[cluster]\nname = "a/b"', "cluster.name"),
    ("[etcd]\nendpoints = []", "etcd.endpoints"),
    ('[etcd]\nendpoints = ["localhost:2379"]', "etcd.endpoints[0]"),
    ('[etcd]\ncontroller_prefix = "controllerd"', "etcd.controller_prefix"),
    ('[etcd]\nmetadata_prefix = "/pulsar/"', "etcd.metadata_prefix"),
    ('[etcd]\nkey_file = "/k.pem"', "etcd.cert_file"),
    ("[etcd]\ntimeout_seconds = 0", "etcd.timeout_seconds"),
    # past ~1e9 s grpc failed every etcd call at once; check-config said ok
    ("[etcd]\ntimeout_seconds = 1e10", "etcd.timeout_seconds"),
    ("[etcd]\ntimeout_seconds = 3600.5", "etcd.timeout_seconds"),
    ("[broker]\ntimeout_seconds = 1e300", "broker.timeout_seconds"),
]


@pytest.mark.parametrize(("text", "name"), INVALID, ids=[t for t, _ in INVALID])
def test_each_rule_is_reported_naming_its_field(text: str, name: str) -> None:
    errors = errors_of(text)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{name}: must"), errors


def test_rule_message_states_rule_and_value() -> None:
    assert errors_of("[autoscale]\ninterval_seconds = -1") == [
        "autoscale.interval_seconds: must be > 0 (got -1)"
    ]


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "localhost:65535", "[::1]:9464"])
def test_valid_listen_addresses(listen: str) -> None:
    http = load(f'[http]\nlisten = "{listen}"').http
    host, port = listen.rsplit(":", 1)
    assert (http.host, http.port) == (host.strip("[]"), int(port))


def test_optional_settings_and_edge_values_accepted() -> None:
    config = load(
        "[gc]\ndefault_retention_seconds = -1\n"
        "[load_report]\nreport_max_interval_seconds = 0\nrate_change_threshold = inf\n"
        '[etcd]\nmetadata_prefix = ""\ncert_file = "/c"\nkey_file = "/k"\n'
        "[election]\nlease_ttl_seconds = 2\n[broker]\nmax_retries = 0\n"
    )
    assert config.gc.default_retention_seconds == -1.0
    assert config.load_report.rate_change_threshold == math.inf


def test_all_errors_are_collected() -> None:
    errors = errors_of(
        "[policy]\nmin_segments = 0\n[broker]\nprofile = 'kafka'\n[http]\nlisten = 'nope'\n"
    )
    assert len(errors) == 3
    assert [e.split(":")[0] for e in errors] == [
        "broker.profile",
        "http.listen",
        "policy.min_segments",
    ]


def test_type_and_rule_errors_are_collected_together() -> None:
    errors = errors_of(
        '[policy]\nmax_segments = "ten"\nmax_segmnts = 3\n[autoscale]\ninterval_seconds = 0\n'
    )
    assert len(errors) == 3, errors


def test_unknown_key_and_table() -> None:
    errors = errors_of("[policy]\nmax_segmnts = 10\n[polcy]\nx = 1\n")
    assert errors[0].startswith("policy.max_segmnts: unknown setting")
    assert "max_segments" in errors[0]  # the suggestion
    assert errors[1].startswith("polcy: unknown table")
    assert errors_of("verbose = true") == ["verbose: unknown setting"]
    assert errors_of("[policy.split_thresholds]\nmsg_in = 1")[0].startswith(
        "policy.split_thresholds.msg_in: unknown setting"
    )


def test_wrong_type_messages_name_field_and_type() -> None:
    assert errors_of('[policy]\nmax_segments = "ten"') == [
        "policy.max_segments: expected an integer, got 'ten'"
    ]
    assert errors_of("[policy]\nmax_segments = 1.5") == [
        "policy.max_segments: expected an integer, got 1.5"
    ]
    assert errors_of("[autoscale]\ninterval_seconds = '60'") == [
        "autoscale.interval_seconds: expected a number, got '60'"
    ]
    assert errors_of('[etcd]\nendpoints = "http://a:2379"') == [
        "etcd.endpoints: expected a list of strings, got 'http://a:2379'"
    ]
    assert errors_of("[etcd]\nendpoints = [1]") == ["etcd.endpoints[0]: expected a string, got 1"]
    assert errors_of("policy = 3") == ["policy: expected a table, got 3"]
    assert errors_of("[policy]\nsplit_thresholds = 3") == [
        "policy.split_thresholds: expected a table, got 3"
    ]


def test_a_rule_is_not_reported_for_a_field_with_a_type_error() -> None:
    # max_segments keeps its default (64) < min_segments, but only the type error matters.
    errors = errors_of('[policy]\nmin_segments = 100\nmax_segments = "many"')
    assert errors == ["policy.max_segments: expected an integer, got 'many'"]


@pytest.mark.parametrize("value", ["1", "0", '"true"'])
def test_bool_accepts_only_booleans(value: str) -> None:
    errors = errors_of(f"[load_report]\nthreshold_crossing = {value}")
    assert errors == [
        f"load_report.threshold_crossing: expected a boolean (true or false), "
        f"got {tomllib.loads('v = ' + value)['v']!r}"
    ]
    assert load("[policy]\nenabled = false").policy.enabled is False


def test_int_is_accepted_for_float_fields() -> None:
    config = load("[autoscale]\ninterval_seconds = 30")
    assert config.autoscale.interval_seconds == 30.0
    assert isinstance(config.autoscale.interval_seconds, float)


def test_inf_accepted_for_merge_combined_max_ratio() -> None:
    assert load("[policy]\nmerge_combined_max_ratio = inf").policy.merge_combined_max_ratio == (
        math.inf
    )


def test_partial_threshold_table_keeps_other_defaults() -> None:
    split = load("[policy.split_thresholds]\nmsg_rate_in = 20000").policy.split_thresholds
    assert split == replace(PolicySettings().split_thresholds, msg_rate_in=20_000.0)


def test_invalid_toml_is_one_error() -> None:
    errors = errors_of("[policy\nmax_segments = 3")
    assert len(errors) == 1
    assert errors[0].startswith("invalid TOML:")


def test_load_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_file(tmp_path / "missing.toml")
    assert len(info.value.errors) == 1
    assert "missing.toml" in info.value.errors[0]
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[cluster]\nname = '\xff'\n")
    with pytest.raises(ConfigError):
        load_file(bad)
    good = tmp_path / "good.toml"
    good.write_text("[policy]\nmax_segments = 8\n")
    assert load_file(good, {"CONTROLLERD_POLICY__MIN_SEGMENTS": "2"}).policy.min_segments == 2


def test_config_error_is_a_value_error_listing_everything() -> None:
    with pytest.raises(ValueError, match=re.escape("policy.min_segments")) as info:
        load("[policy]\nmin_segments = 0")
    assert isinstance(info.value, ConfigError)


# --- environment overrides ---------------------------------------------------------


def test_env_overrides_int_nested_list_and_strings() -> None:
    config = load(
        "",
        {
            "CONTROLLERD_POLICY__MAX_SEGMENTS": "32",
            "CONTROLLERD_POLICY__SPLIT_THRESHOLDS__MSG_RATE_IN": "5000",
            "CONTROLLERD_ETCD__ENDPOINTS": '["http://a:2379","http://b:2379"]',
            "CONTROLLERD_BROKER__ADMIN_URL": "https://pulsar:8443",  # not TOML: plain string
            "CONTROLLERD_CLUSTER__NAME": "123",  # a string field keeps the text
            "CONTROLLERD_AUDIT__TOPIC": '"quoted"',  # a TOML string is unquoted
            "CONTROLLERD_POLICY__MERGE_COMBINED_MAX_RATIO": "inf",
            "CONTROLLERD_LOAD_REPORT__THRESHOLD_CROSSING": "false",
        },
    )
    assert config.policy.max_segments == 32
    assert config.policy.split_thresholds.msg_rate_in == 5000.0
    assert config.etcd.endpoints == ("http://a:2379", "http://b:2379")
    assert config.broker.admin_url == "https://pulsar:8443"
    assert config.cluster.name == "123"
    assert config.audit.topic == "quoted"
    assert config.policy.merge_combined_max_ratio == math.inf
    assert config.load_report.threshold_crossing is False


def test_env_wins_over_file_and_names_are_case_insensitive() -> None:
    text = "[policy]\nmax_segments = 16\nmin_segments = 2\n"
    config = load(text, {"controllerd_policy__max_segments": "8"})
    assert (config.policy.min_segments, config.policy.max_segments) == (2, 8)


def test_env_inline_table_merges_into_file_table() -> None:
    text = "[policy.split_thresholds]\nmsg_rate_in = 20000\n"
    env = {"CONTROLLERD_POLICY__SPLIT_THRESHOLDS": "{ byte_rate_in = 6e7 }"}
    split = load(text, env).policy.split_thresholds
    assert (split.msg_rate_in, split.byte_rate_in) == (20_000.0, 6e7)


def test_env_empty_value_unsets_optional_setting() -> None:
    text = '[broker]\ntoken_file = "/etc/token"\n'
    assert load(text).broker.token_file == "/etc/token"
    assert load(text, {"CONTROLLERD_BROKER__TOKEN_FILE": ""}).broker.token_file is None


def test_env_unknown_variable_is_an_error_naming_it() -> None:
    errors = errors_of("", {"CONTROLLERD_POLICY__MAX_SEGMNTS": "3", "CONTROLLERD_NOPE__X": "1"})
    assert [e.split(":")[0] for e in errors] == [
        "CONTROLLERD_NOPE__X",
        "CONTROLLERD_POLICY__MAX_SEGMNTS",
    ]


def test_env_names_without_a_table_are_not_overrides() -> None:
    # What Kubernetes injects for a Service named "controllerd".
    env = {"CONTROLLERD_SERVICE_HOST": "10.0.0.1", "CONTROLLERD_PORT_9464_TCP": "tcp://x"}
    assert load("", env) == Config()


def test_env_unrelated_and_config_path_variables_are_ignored() -> None:
    env = {"CONTROLLERD_CONFIG": "/etc/x.toml", "PATH": "/bin", "POLICY__MAX_SEGMENTS": "x"}
    assert load("", env) == Config()


def test_env_errors_name_the_variable() -> None:
    assert errors_of("", {"CONTROLLERD_POLICY__MAX_SEGMENTS": "ten"}) == [
        "policy.max_segments: expected an integer, got 'ten' "
        "(from CONTROLLERD_POLICY__MAX_SEGMENTS)"
    ]
    errors = errors_of("", {"CONTROLLERD_POLICY__MIN_SEGMENTS": "0"})
    assert errors[0].endswith("(from CONTROLLERD_POLICY__MIN_SEGMENTS)")


def test_env_value_must_be_one_toml_value() -> None:
    errors = errors_of("", {"CONTROLLERD_POLICY__MAX_SEGMENTS": "8\nmin_segments = 0"})
    assert errors == [
        "policy.max_segments: expected an integer, got '8\\nmin_segments = 0' "
        "(from CONTROLLERD_POLICY__MAX_SEGMENTS)"
    ]
    # One string, never TOML: no key "bogus" is set (the name itself is refused since
    # it cannot go in an HTTP header).
    env = {"CONTROLLERD_CLUSTER__NAME": 'x"\nbogus = "y'}
    (error,) = errors_of("", env)
    assert error.startswith("cluster.name: must be non-empty printable ASCII without '/'")
    assert "'x\"\\nbogus = \"y'" in error


ENV_NAMES = sorted("CONTROLLERD_" + name.upper().replace(".", "__") for name, _ in leaf_fields())


@given(st.sampled_from(ENV_NAMES), st.text())
def test_any_env_value_gives_a_config_or_a_config_error(name: str, value: str) -> None:
    try:
        load("", {name: value})
    except ConfigError as exc:
        assert exc.errors
        assert all(isinstance(e, str) and ": " in e for e in exc.errors)


# --- reload and to_dict ------------------------------------------------------------


def test_restart_required() -> None:
    old = load("")
    new = load('[etcd]\nendpoints = ["http://other:2379"]\n[policy]\nmax_segments = 8\n')
    assert restart_required(old, new) == ["etcd.endpoints"]
    assert restart_required(old, load("[policy]\nmax_segments = 8")) == []
    assert restart_required(
        old, load('[http]\nlisten = "0.0.0.0:1"\n[election]\nlease_ttl_seconds = 20')
    ) == [
        "election.lease_ttl_seconds",
        "http.listen",
    ]


def test_a_reload_applies_only_the_reloadable_settings() -> None:
    """A SIGHUP used to put restart-only values in force too (read later: the lease TTL)."""
    old = load("")
    token = "/run/secrets/token"
    new = load(
        f'[broker]\nprofile = "reference"\ntoken_file = "{token}"\n'
        "[election]\nlease_ttl_seconds = 20\n"
        "[policy.split_thresholds]\nmsg_rate_in = 2000\n"
        '[logging]\nlevel = "debug"\n'
    )
    applied = cfg.reloaded(old, new)
    assert applied.broker == replace(old.broker, token_file=token)
    assert applied.election == old.election
    assert (applied.metadata_prefix, applied.gc_enabled) == (old.metadata_prefix, old.gc_enabled)
    assert applied.policy == new.policy and applied.logging == new.logging
    assert restart_required(old, applied) == []
    assert restart_required(applied, new) == restart_required(old, new)
    assert cfg.reloaded(old, load("[policy]\nmax_segments = 8")) == load(
        "[policy]\nmax_segments = 8"
    )


def test_reload_marks() -> None:
    restart_only = {name for name, f in leaf_fields() if not f.metadata.get("reload", True)}
    assert restart_only == {
        "cluster.name",
        *(f"etcd.{f.name}" for f in fields(cfg.EtcdSettings)),
        "election.lease_ttl_seconds",
        "election.mode",
        "election.shards",
        "http.listen",
        # the admin client and the audit producer are built once, at start
        *(f"broker.{f.name}" for f in fields(cfg.BrokerSettings) if f.name != "token_file"),
        *(f"audit.{f.name}" for f in fields(cfg.AuditSettings)),
    }


def test_to_dict_has_policy_values() -> None:
    d = to_dict(load(""))
    assert d["policy"]["max_segments"] == 64
    assert d["policy"]["split_thresholds"] == {
        "msg_rate_in": 10_000.0,
        "byte_rate_in": 50e6,
        "msg_rate_out": 50_000.0,
        "byte_rate_out": 250e6,
    }
    assert d["etcd"]["endpoints"] == ["http://127.0.0.1:2379"]
    assert "token_file" not in d["broker"]  # unset: TOML has no null
    json.dumps(d)  # plain data only


def _toml(table: dict[str, Any], prefix: str = "") -> str:
    """Minimal TOML writer for to_dict output (tables, str, bool, numbers, lists)."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    scalars = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = [f"[{prefix}]", *scalars] if prefix else scalars
    for k, v in table.items():
        if isinstance(v, dict):
            out.append(_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(out)


def test_to_dict_round_trips_through_load() -> None:
    config = load(
        '[etcd]\nendpoints = ["http://a:2379", "https://b:2379"]\nusername = "u"\n'
        '[broker]\ntoken_file = "/t"\n[policy]\nmerge_combined_max_ratio = inf\n'
        "max_split_fanout = 2\n[policy.merge_thresholds]\nmsg_rate_in = 0.5\n"
    )
    assert load(_toml(to_dict(config))) == config
    assert load(_toml(to_dict(Config()))) == Config()


@pytest.mark.parametrize("value", [1e308, 315_360_001, math.nan, -1.0])
def test_policy_durations_are_bounded_to_ten_years(value: float) -> None:
    """1e308 s passed as finite, then overflowed as milliseconds (an internal error)."""
    (err,) = PolicySettings(merge_window_seconds=value).errors()
    assert err.startswith("policy.merge_window_seconds: must be between 0 and 315,360,000")
    assert PolicySettings(merge_window_seconds=315_360_000).errors() == []


@pytest.mark.parametrize(
    ("audit", "message"),
    [
        ({"kafka_bootstrap": "k1:9092,nope:x"}, "audit.kafka_bootstrap: expected host[:port]"),
        ({"kafka_bootstrap": "k1:99999"}, "audit.kafka_bootstrap: expected host[:port]"),
        ({"kafka_bootstrap": "k1:\u00b2"}, "audit.kafka_bootstrap: expected host[:port]"),
        ({"kafka_bootstrap": "k1:9092", "topic": "bad topic"}, "audit.topic: a Kafka topic"),
        ({"topic": "x" * 250}, "audit.topic: a Kafka topic"),
    ],
)
def test_audit_addresses_and_topic_are_checked_at_start(
    audit: dict[str, str], message: str
) -> None:
    """They used to pass and fail only at run time, as a retry logged forever."""
    settings = cfg.AuditSettings(kafka_bootstrap=audit.get("kafka_bootstrap"))
    if "topic" in audit:
        settings = replace(settings, topic=audit["topic"])
    (err,) = settings.errors()
    assert err.startswith(message)
    for servers in ("k1:9092, k2:9093", "kafka", "k1,k2", "[::1]", "[::1]:9092"):
        assert cfg.AuditSettings(kafka_bootstrap=servers, topic="a.b_c-1").errors() == []


def test_request_timeouts_up_to_an_hour_are_accepted() -> None:
    config = load("[etcd]\ntimeout_seconds = 3600\n[broker]\ntimeout_seconds = 3600")
    assert (config.etcd.timeout_seconds, config.broker.timeout_seconds) == (3600, 3600)


def test_a_byte_order_mark_is_skipped() -> None:
    """Refused before as "invalid TOML: Invalid statement (line 1, column 1)"."""
    assert load("\ufeff[etcd]\ntimeout_seconds = 3").etcd.timeout_seconds == 3


def test_a_file_of_only_a_byte_order_mark_is_empty() -> None:
    assert is_empty("\ufeff") and is_empty("\ufeff# a comment\n")
