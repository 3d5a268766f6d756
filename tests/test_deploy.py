"""Deployment artefacts: systemd unit, container image, Kubernetes manifests, dashboard.

What this machine cannot run (a systemd manager as PID 1, a Docker engine, a
Kubernetes API server) is checked statically, with the real tools where they work
offline: ``systemd-analyze verify``/``security``, the Kubernetes OpenAPI schemas
(``kubernetes-validate``), a PromQL parser. What the daemon promises to those
supervisors is checked for real: ``controllerd run`` as a subprocess talking to a
stand-in notification socket, real etcd, an in-process test broker.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import kubernetes_validate  # type: ignore[import-untyped]
import promql_parser
import pytest
import yaml

from controllerd import config as config_mod
from controllerd.adapters.store import Store
from controllerd.core.model import Layout, TopicName
from controllerd.core.view import Keys
from controllerd.daemon.metrics import Metrics
from controllerd.daemon.runtime import SHUTDOWN_DEADLINE
from tests.support.broker import (
    TestBrokerState,
    layout_json,
    load_json,
    mirror_into,
    serve_test_broker,
)
from tests.support.daemon import Replica, wait_until, write_config
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port
from tests.support.notify import NotifySocket, notify_socket

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "controllerd.service"
DROP_IN = ROOT / "systemd" / "controllerd.service.d" / "credentials.conf"
ENV_EXAMPLE = ROOT / "systemd" / "controllerd.env.example"
TMPFILES = ROOT / "systemd" / "controllerd.tmpfiles"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
KUBERNETES = ROOT / "config" / "kubernetes"
PROMETHEUS_OPERATOR = KUBERNETES / "prometheus-operator"
RULES = ROOT / "config" / "prometheus" / "controllerd-rules.yaml"
RULES_TESTS = ROOT / "config" / "prometheus" / "controllerd-rules.test.yaml"
OPERATIONS_DOC = ROOT / "docs" / "operations.md"
DASHBOARD = ROOT / "dashboards" / "controllerd.json"
REFERENCE_CONFIG = ROOT / "config" / "controllerd.toml"

#: The Kubernetes release whose OpenAPI schemas the manifests must satisfy.
KUBERNETES_VERSION = "1.37.0"
#: What both the image and the unit run.
RUN_ARGS = ["run", "--config", "/etc/controllerd/controllerd.toml"]
INSTALL_PREFIX = "/opt/controllerd"

# --- systemd ----------------------------------------------------------------------


def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as section -> [(key, value)], in order; keys may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def one(entries: list[tuple[str, str]], key: str) -> str:
    values = [v for k, v in entries if k == key]
    assert len(values) == 1, f"{key}: expected exactly one, got {values}"
    return values[0]


_SPAN_UNITS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def timespan(value: str) -> float:
    """A systemd time span ("20", "20s", "1min 30s") in seconds."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * _SPAN_UNITS[unit or "s"]
    return total


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The unit and its drop-in, with ExecStart pointing at this venv's ``controllerd``.

    ``systemd-analyze verify`` requires ExecStart's program to exist; on a host it is
    the venv at /opt/controllerd (docs/operations.md), here the test venv.
    """
    program = Path(sys.executable).parent / "controllerd"
    assert program.exists(), program
    text = UNIT.read_text(encoding="utf-8")
    assert f"ExecStart={INSTALL_PREFIX}/bin/controllerd " in text
    (tmp_path / UNIT.name).write_text(
        text.replace(f"{INSTALL_PREFIX}/bin/controllerd", str(program)), encoding="utf-8"
    )
    drop_ins = tmp_path / DROP_IN.parent.name
    drop_ins.mkdir()
    shutil.copy(DROP_IN, drop_ins / DROP_IN.name)
    return tmp_path


def systemd_analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze missing: install Debian's systemd package (dev.sh does)"
    return subprocess.run(
        [tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_systemd_analyze_verify_accepts_the_unit_and_its_drop_in(unit_dir: Path) -> None:
    result = systemd_analyze("verify", "--man=no", f"./{UNIT.name}", cwd=unit_dir)
    # Unknown keys and bad values are only warnings: any output is a failure.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_systemd_analyze_security_rates_the_sandbox_ok(unit_dir: Path) -> None:
    result = systemd_analyze("security", "--offline=yes", f"./{UNIT.name}", cwd=unit_dir)
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", result.stdout)
    assert match, result.stdout
    print(f"\nsystemd-analyze security: {match[1]} {match[2]}")
    assert float(match[1]) <= 2.0, result.stdout


def test_unit_supervises_as_the_daemon_expects() -> None:
    service = unit_entries(UNIT)["Service"]
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    assert shlex.split(one(service, "ExecStart")) == [
        f"{INSTALL_PREFIX}/bin/controllerd",
        *RUN_ARGS,
    ]
    assert one(service, "ExecReload") == "/bin/kill -HUP $MAINPID"
    # Whatever the exit status, even 0: a daemon that stops on its own is a failure.
    assert one(service, "Restart") == "always"
    assert 1 <= timespan(one(service, "RestartSec")) <= 30
    unit = unit_entries(UNIT)["Unit"]
    burst, interval = (
        int(one(unit, "StartLimitBurst")),
        timespan(one(unit, "StartLimitIntervalSec")),
    )
    # The start limit stops a crash loop (a config error), never a slow etcd outage:
    # attempts that each wait TimeoutStartSec for etcd stay under the burst.
    start_timeout = timespan(one(service, "TimeoutStartSec"))
    assert interval / (start_timeout + timespan(one(service, "RestartSec"))) < burst
    assert burst * timespan(one(service, "RestartSec")) < interval
    assert "RestartPreventExitStatus" not in dict(service)
    watchdog = timespan(one(service, "WatchdogSec"))
    assert watchdog > 0
    stop = timespan(one(service, "TimeoutStopSec"))
    assert stop > SHUTDOWN_DEADLINE, "systemd would SIGKILL a shutdown still in its deadline"
    assert one(service, "EnvironmentFile").startswith("-/etc/controllerd/")


def test_unit_runs_sandboxed_without_privileges() -> None:
    service = dict(unit_entries(UNIT)["Service"])
    expected = {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "RestrictSUIDSGID": "yes",
        "MemoryDenyWriteExecute": "yes",
    }
    assert {k: service.get(k) for k in expected} == expected
    # /proc/stat must stay visible: the process_* metrics read the boot time there.
    assert "ProcSubset" not in service


def test_secrets_reach_the_daemon_as_credential_files_never_as_arguments() -> None:
    entries = unit_entries(DROP_IN)["Service"]
    credentials = dict(v.split(":", 1) for k, v in entries if k == "LoadCredential")
    assert set(credentials) == {"broker-token", "etcd-password"}
    assert all(p.startswith("/etc/controllerd/credentials/") for p in credentials.values())
    env = dict(v.split("=", 1) for k, v in entries if k == "Environment")
    assert env == {
        "CONTROLLERD_BROKER__TOKEN_FILE": "%d/broker-token",
        "CONTROLLERD_ETCD__PASSWORD_FILE": "%d/etcd-password",
    }
    # The variables are real settings (an unknown CONTROLLERD_* stops the daemon).
    resolved = {k: v.replace("%d", "/run/credentials/controllerd.service") for k, v in env.items()}
    config = config_mod.load("", {**resolved, "CONTROLLERD_ETCD__USERNAME": "controllerd"})
    assert config.broker.token_file == "/run/credentials/controllerd.service/broker-token"
    assert config.etcd.password_file == "/run/credentials/controllerd.service/etcd-password"
    exec_start = one(unit_entries(UNIT)["Service"], "ExecStart")
    assert not re.search(r"token|password|secret", exec_start, re.IGNORECASE)


def test_environment_file_example_names_only_real_settings() -> None:
    env: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text(encoding="utf-8").splitlines():
        if m := re.fullmatch(r"#(CONTROLLERD_[A-Z_]+)=(.*)", line):
            # systemd strips one level of quoting, like a shell.
            env[m[1]] = shlex.split(m[2])[0]
    assert len(env) >= 5
    config = config_mod.load("", env)
    assert len(config.etcd.endpoints) == 3
    assert config.http.listen == "0.0.0.0:9464"


def test_tmpfiles_creates_root_only_credential_directory() -> None:
    lines = [
        line.split()
        for line in TMPFILES.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert all(len(fields) == 7 and fields[0] == "d" for fields in lines), lines
    by_path = {fields[1]: fields[2:5] for fields in lines}
    assert by_path["/etc/controllerd/credentials"] == ["0700", "root", "root"]
    assert by_path["/etc/controllerd"] == ["0755", "root", "root"]


# --- container image ------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON-array form of ENTRYPOINT/CMD/HEALTHCHECK CMD (shell form is refused)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD ") + len("CMD ") :]
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
        return value


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions, one list per stage (each starts with FROM)."""
    logical: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments vanish even inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    stages: list[list[Instruction]] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        elif instruction.keyword != "ARG":
            assert stages, f"{keyword} before FROM"
        if stages:
            stages[-1].append(instruction)
    return stages


def instructions(stage: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in stage if i.keyword == keyword]


def test_dockerfile_builds_a_wheel_and_installs_only_that_into_a_slim_final_stage() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage"
    build, final = stages[0], stages[-1]
    assert re.fullmatch(r"\S+ AS build", build[0].args, re.IGNORECASE)
    builds = " ".join(i.args for i in instructions(build, "RUN"))
    assert "pip wheel" in builds
    assert "--no-index --find-links /wheels controllerd" in builds, "installed from the wheel"
    default_base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert default_base and re.fullmatch(r"python:3\.11-slim(-\w+)?", default_base[1])
    assert final[0].args == "${PYTHON_IMAGE}"
    # No compilers or package installs in the final stage; it only copies the built venv.
    final_runs = " ".join(i.args for i in instructions(final, "RUN"))
    for tool in ("apt-get install", "build-essential", "gcc", "pip install", "pip wheel"):
        assert tool not in final_runs, f"final stage runs {tool}"
    copied = [i.args.split() for i in instructions(final, "COPY") if "--from=build" in i.args]
    assert {c[-1] for c in copied} == {f"{INSTALL_PREFIX}", "/usr/bin/tini"}


def test_image_runs_controllerd_as_non_root_with_a_healthcheck() -> None:
    final = dockerfile_stages()[-1]
    (user,) = instructions(final, "USER")
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric non-root, so runAsNonRoot can check it"
    assert gid.isdigit() and int(gid) != 0
    (entrypoint,) = instructions(final, "ENTRYPOINT")
    (cmd,) = instructions(final, "CMD")
    argv = entrypoint.exec_form() + cmd.exec_form()
    assert argv[:2] == ["/usr/bin/tini", "--"], "an init as PID 1 that forwards signals"
    assert argv[2:] == ["controllerd", *RUN_ARGS]
    env = " ".join(i.args for i in instructions(final, "ENV"))
    assert f"PATH={INSTALL_PREFIX}/bin:" in env, "the same venv the systemd unit runs"
    (healthcheck,) = instructions(final, "HEALTHCHECK")
    assert "/healthz" in " ".join(healthcheck.exec_form())
    assert "9464" in " ".join(i.args for i in instructions(final, "EXPOSE"))


def _dockerignore_included(path: str) -> bool:
    """Whether ``path`` reaches the build context: the last matching pattern wins, a
    pattern matching a parent directory matches the path (Docker's rules, with fnmatch)."""
    included = True
    for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch(p, pattern) or fnmatch(p, pattern.removeprefix("**/")) for p in prefixes):
            included = negate
    return included


def test_dockerignore_admits_what_the_build_copies_and_nothing_else() -> None:
    sources = [
        src
        for stage in dockerfile_stages()
        for i in instructions(stage, "COPY")
        if "--from=" not in i.args
        for src in i.args.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert _dockerignore_included(src.rstrip("/")), src
    for private in (".venv/bin/python", ".git/config", "tests/test_deploy.py", ".env"):
        assert not _dockerignore_included(private), private
    assert not _dockerignore_included("controllerd/__pycache__/x.pyc")


# --- Kubernetes -----------------------------------------------------------------


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """What ``kubectl apply -k DIRECTORY`` would apply, rendered by kustomize itself."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl missing (it embeds kustomize): install it (dev.sh does)"
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']}s"
        out[doc["kind"]] = doc
    return out


@functools.cache
def _rendered() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(KUBERNETES))


def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind ``kubectl apply -k config/kubernetes/`` applies."""
    return copy.deepcopy(by_kind(list(_rendered())))


def with_prometheus_operator(tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The manifests with the prometheus-operator component enabled, as the comment says."""
    copied = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copied)
    kustomization = copied / "kustomization.yaml"
    text = kustomization.read_text(encoding="utf-8")
    enabled = text.replace(
        "# components:\n#   - prometheus-operator", "components:\n  - prometheus-operator"
    )
    assert enabled != text, "kustomization.yaml no longer offers the component as documented"
    kustomization.write_text(enabled, encoding="utf-8")
    return by_kind(kustomize(copied))


def test_kustomization_lists_every_manifest_file() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    on_disk = {p.name for p in KUBERNETES.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk, "kustomization.yaml must list every manifest"
    component = yaml.safe_load((PROMETHEUS_OPERATOR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in PROMETHEUS_OPERATOR.glob("*.y*ml")} - {"kustomization.yaml"}
    assert component["kind"] == "Component" and set(component["resources"]) == on_disk


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = manifests()["Deployment"]["spec"]["template"]["spec"]
    return spec


def container() -> dict[str, Any]:
    (only,) = pod_spec()["containers"]
    assert isinstance(only, dict)
    return only


def embedded_toml() -> str:
    text: str = manifests()["ConfigMap"]["data"]["controllerd.toml"]
    assert text == (KUBERNETES / "controllerd.toml").read_text(encoding="utf-8")
    return text


@pytest.mark.parametrize(
    "kind",
    [
        "ConfigMap",
        "Deployment",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
        "NetworkPolicy",
    ],
)
def test_manifest_validates_against_the_kubernetes_schema(kind: str) -> None:
    doc = manifests()[kind]
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_is_strict_about_unknown_fields() -> None:
    deployment = copy.deepcopy(manifests()["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_configmap_config_loads_and_probes_reach_its_listen_address() -> None:
    config = config_mod.load(embedded_toml(), env_from(container()))
    assert config.http.host not in ("127.0.0.1", "localhost", "::1"), "kubelet cannot reach it"
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"ops": config.http.port}
    probes = {
        name: container()[name]["httpGet"]
        for name in ("startupProbe", "livenessProbe", "readinessProbe")
    }
    assert {name: (p["path"], p["port"]) for name, p in probes.items()} == {
        "startupProbe": ("/healthz", "ops"),
        "livenessProbe": ("/healthz", "ops"),
        "readinessProbe": ("/readyz", "ops"),
    }
    service = manifests()["Service"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "ops"
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.http.port)
    assert annotations["prometheus.io/path"] == "/metrics"


def env_from(spec: Mapping[str, Any]) -> dict[str, str]:
    """The plain ``env`` values of a container (valueFrom entries need a cluster)."""
    return {e["name"]: e["value"] for e in spec.get("env", []) if "value" in e}


def test_a_config_change_renames_the_configmap_so_the_deployment_rolls_out(
    tmp_path: Path,
) -> None:
    """kustomize's configMapGenerator: the name carries a hash of controllerd.toml."""
    (volume,) = [v for v in pod_spec()["volumes"] if v["name"] == "config"]
    name = manifests()["ConfigMap"]["metadata"]["name"]
    assert volume["configMap"]["name"] == name and name.startswith("controllerd-config-")
    edited = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, edited)
    toml = edited / "controllerd.toml"
    toml.write_text(toml.read_text(encoding="utf-8").replace('"info"', '"debug"'), "utf-8")
    after = by_kind(kustomize(edited))
    renamed = after["ConfigMap"]["metadata"]["name"]
    assert renamed != name and renamed.startswith("controllerd-config-")
    (volume,) = [
        v
        for v in after["Deployment"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    ]
    assert volume["configMap"]["name"] == renamed
    assert "checksum/config" not in (
        manifests()["Deployment"]["spec"]["template"]["metadata"].get("annotations") or {}
    )


def test_network_policy_admits_only_prometheus_to_the_ops_port() -> None:
    policy = manifests()["NetworkPolicy"]["spec"]
    labels = manifests()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]  # egress to etcd and the broker stays open
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "ops", "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}


def test_service_monitor_and_prometheus_rule_scrape_and_alert_as_shipped(
    tmp_path: Path,
) -> None:
    """The Prometheus Operator component (its CRDs are not in kubernetes-validate).

    The PrometheusRule's groups must be exactly the rules file that promtool checks
    and unit-tests below; the ServiceMonitor must select the Service and scrape its
    ops port.
    """
    docs = with_prometheus_operator(tmp_path)
    base = {k: v for k, v in docs.items() if k not in ("ServiceMonitor", "PrometheusRule")}
    assert base == manifests()
    monitor, rule = docs["ServiceMonitor"], docs["PrometheusRule"]
    for doc in (monitor, rule):
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert doc["metadata"]["name"] == "controllerd"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert rule["spec"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))
    service = manifests()["Service"]
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": service["spec"]["ports"][0]["name"],
        "path": "/metrics",
        "scheme": "http",
        "interval": "15s",
        "scrapeTimeout": "10s",
    }


# --- Prometheus rules -------------------------------------------------------------


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool, "promtool missing: install Debian's prometheus package (dev.sh does)"
    return subprocess.run(
        [tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_accepts_the_alert_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout), result.stdout


def test_alert_rules_pass_their_promtool_unit_tests(tmp_path: Path) -> None:
    """``promtool test rules`` on a copy without annotations (see the test file's header)."""
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules), encoding="utf-8")
    shutil.copy(RULES_TESTS, tmp_path / RULES_TESTS.name)
    result = promtool("test", "rules", RULES_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES_TESTS.read_text(encoding="utf-8")))
    assert tested == {r["alert"] for g in rules["groups"] for r in g["rules"]}, "untested alerts"


def test_alert_rules_use_only_exported_metrics_and_labels() -> None:
    exported = exported_metrics()
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            query = parse_query(rule["expr"])
            for selector in query.selectors:
                assert selector.name in exported, (
                    f"{rule['alert']}: {selector.name} is not exported"
                )
                own = exported[selector.name] | TARGET_LABELS
                for matcher in selector.matchers.matchers:
                    assert matcher.name in own, f"{rule['alert']}: no label {matcher.name}"
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["annotations"]["runbook"] == "docs/operations.md#alerts"
            assert rule["alert"] in OPERATIONS_DOC.read_text(encoding="utf-8"), rule["alert"]


# --- Grafana ----------------------------------------------------------------------

#: Labels Prometheus attaches to every target, in addition to the metric's own.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service"}


def exported_metrics() -> dict[str, set[str]]:
    """Every series name /metrics can expose -> the label names it carries."""
    metrics = Metrics()
    labels: dict[str, set[str]] = {}
    wrappers = {
        w._name: set(w._labelnames) for w in vars(metrics).values() if hasattr(w, "_labelnames")
    }
    for family in metrics.registry.collect():
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
        }.get(family.type, [""])
        own = wrappers.get(family.name, set()) | {k for s in family.samples for k in s.labels}
        for suffix in suffixes:
            labels[family.name + suffix] = own | ({"le"} if suffix == "_bucket" else set())
    return labels


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    return queries


@dataclass
class Query:
    """The parts of one PromQL query that name metrics and labels."""

    selectors: list[promql_parser.VectorSelector]
    groupings: list[list[str]]


def parse_query(expr: str) -> Query:
    """A Grafana query parsed as PromQL, its interval variables replaced by a duration."""
    ast = promql_parser.parse(re.sub(r"\$__(rate_)?interval", "5m", expr))
    query = Query([], [])

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            query.selectors.append(node)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            query.groupings.append(list(node.modifier.labels))

    promql_parser.walk(ast, visit)
    return query


def test_dashboard_queries_parse_and_use_only_exported_metrics_and_labels() -> None:
    exported = exported_metrics()
    used: set[str] = set()
    for expr in dashboard_queries():
        query = parse_query(expr)
        assert query.selectors, expr
        available = set(TARGET_LABELS)
        for selector in query.selectors:
            assert selector.name in exported, f"{selector.name} is not exported: {expr}"
            used.add(selector.name)
            own = exported[selector.name] | TARGET_LABELS
            available |= own
            for matcher in selector.matchers.matchers:
                assert matcher.name in own, f"{selector.name} has no label {matcher.name}"
        for grouping in query.groupings:
            assert set(grouping) <= available, f"grouping by unknown labels {grouping}: {expr}"
    suffix = r"_(total|bucket|sum|count)$"
    shown = {re.sub(suffix, "", name) for name in used}
    ours = {re.sub(suffix, "", name) for name in exported if name.startswith("controllerd_")}
    assert ours - shown == set(), "metrics without a panel"


def test_dashboard_is_importable_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, panel["title"]


# --- the daemon under a stand-in systemd ----------------------------------------

TOPIC = TopicName("acme", "ns", "orders")
WATCHDOG_USEC = 1_000_000


@dataclass
class Supervised:
    """A ``controllerd run`` subprocess, its notification socket and its cluster."""

    replica: Replica
    notify: NotifySocket
    broker: TestBrokerState
    store: Store
    keys: Keys

    def splits(self) -> int:
        return sum(1 for r in self.broker.requests if "/split/" in r.path)

    async def add_hot_topic(self, msg_rate_in: float) -> Layout:
        layout = self.broker.add_topic(TOPIC, 1)
        await self.store.put(self.keys.layout(TOPIC), layout_json(layout))
        await self.put_load(msg_rate_in)
        return layout

    async def put_load(self, msg_rate_in: float) -> None:
        await self.store.put(self.keys.load(TOPIC, 0), load_json(msg_rate_in))

    async def metric(self, name: str, **labels: str) -> float:
        return await self.replica.metric(name, **labels) or 0.0

    async def sighup(self, text: str) -> dict[str, str]:
        """Replace the config file, SIGHUP, and return the READY=1 that ends the reload."""
        self.replica.config.write_text(text, encoding="utf-8")
        self.replica.signal(signal.SIGHUP)
        reloading = await self.notify.expect("RELOADING", within=5)
        assert reloading["MONOTONIC_USEC"].isdigit(), "systemd matches reloads by this"
        return await self.notify.expect("READY", within=5)


StartSupervised = Callable[..., contextlib.AbstractAsyncContextManager[Supervised]]
"""``start(extra="", env=None)``: a running supervised daemon, stopped on exit."""


@pytest.fixture
def make_supervised(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> StartSupervised:
    """Start ``controllerd run`` like systemd would: NOTIFY_SOCKET and WATCHDOG_USEC set."""

    @contextlib.asynccontextmanager
    async def start(
        extra: str = "", env: Mapping[str, str] | None = None
    ) -> AsyncIterator[Supervised]:
        keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
        state = TestBrokerState(profile="reference")

        state.on_layout_change = mirror_into(store, keys)
        with notify_socket(tmp_path) as notify:
            async with serve_test_broker(state) as url:
                port = free_port()
                path = write_config(
                    tmp_path / "controllerd.toml",
                    etcd=etcd_server.endpoint,
                    prefix=etcd_prefix,
                    broker_url=url,
                    port=port,
                    extra=extra,
                )
                replica = Replica(
                    "supervised",
                    path,
                    port,
                    tmp_path / "controllerd.log",
                    env={**notify.env, "WATCHDOG_USEC": str(WATCHDOG_USEC), **(env or {})},
                )
                replica.start()
                try:
                    yield Supervised(replica, notify, state, store, keys)
                finally:
                    with anyio.CancelScope(shield=True):
                        await replica.stop()

    return start


def run_healthcheck(config: Path) -> int:
    """The image's HEALTHCHECK command, with this interpreter as its ``python``."""
    (healthcheck,) = instructions(dockerfile_stages()[-1], "HEALTHCHECK")
    argv = healthcheck.exec_form()
    assert argv[0] == "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLLERD_")}
    env["CONTROLLERD_CONFIG"] = str(config)
    return subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30, check=False
    ).returncode


async def test_daemon_notifies_ready_watchdog_and_stopping_and_exits_cleanly(
    make_supervised: StartSupervised,
) -> None:
    async with make_supervised() as daemon:
        await daemon.notify.expect("READY", within=20)
        assert await daemon.replica.ready(), "READY=1 only once /readyz is 200"
        for _ in range(3):
            await daemon.notify.expect("WATCHDOG", within=2 * WATCHDOG_USEC / 1e6)
        pings = daemon.notify.times("WATCHDOG")
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert max(gaps) < WATCHDOG_USEC / 1e6, f"pings must beat WatchdogSec: {gaps}"
        assert await anyio.to_thread.run_sync(run_healthcheck, daemon.replica.config) == 0

        started = time.monotonic()
        daemon.replica.signal(signal.SIGTERM)
        await daemon.notify.expect("STOPPING", within=5)
        code = await anyio.to_thread.run_sync(daemon.replica.wait, SHUTDOWN_DEADLINE)
        took = time.monotonic() - started
        print(f"\nSIGTERM to exit: {took * 1000:.0f} ms (deadline {SHUTDOWN_DEADLINE:.0f} s)")
        assert code == 0
        assert await anyio.to_thread.run_sync(run_healthcheck, daemon.replica.config) != 0


async def test_sighup_applies_a_changed_setting_and_survives_invalid_files(
    make_supervised: StartSupervised,
) -> None:
    disabled = "[policy]\nenabled = false\nsplit_cooldown_seconds = 0\n"
    async with make_supervised(extra=disabled) as daemon:
        await daemon.notify.expect("READY", within=20)
        original = daemon.replica.config.read_text(encoding="utf-8")
        await daemon.add_hot_topic(30_000.0)  # 3x the split threshold

        async def refused_while_disabled() -> bool:
            return (
                await daemon.metric("controllerd_decisions_total", action="none", reason="disabled")
                >= 1
            )

        await wait_until(refused_while_disabled)

        # A TOML syntax error, then a rule violation: both rejected, the daemon lives on.
        await daemon.sighup(original + "\n[policy\n")
        await daemon.sighup(original.replace("[policy]\n", "[policy]\nmin_segments = 0\n"))
        invalid = await daemon.metric("controllerd_config_reloads_total", outcome="invalid")
        assert invalid == 2
        assert await daemon.metric("controllerd_config_reloads_total", outcome="ok") == 0
        assert daemon.replica.alive() and await daemon.replica.ready()
        rejected = [
            e for e in daemon.replica.log_events() if e.get("event") == "config.reload.rejected"
        ]
        assert len(rejected) == 2
        assert any("policy.min_segments" in err for err in rejected[-1]["errors"])
        assert daemon.splits() == 0

        await daemon.sighup(original.replace("enabled = false", "enabled = true"))
        assert await daemon.metric("controllerd_config_reloads_total", outcome="ok") == 1
        await daemon.put_load(30_001.0)  # the next evaluation sees the new setting

        async def split() -> bool:
            return daemon.splits() == 1

        await wait_until(split, within=10)
        assert len(daemon.broker.topics[TOPIC].active_segments()) >= 3


async def test_sighup_rotates_the_broker_token(
    make_supervised: StartSupervised, tmp_path: Path
) -> None:
    token = tmp_path / "broker-token"
    token.write_text("old-token\n", encoding="utf-8")
    async with make_supervised(env={"CONTROLLERD_BROKER__TOKEN_FILE": str(token)}) as daemon:
        await daemon.notify.expect("READY", within=20)
        token.write_text("new-token\n", encoding="utf-8")
        await daemon.sighup(daemon.replica.config.read_text(encoding="utf-8"))
        assert await daemon.metric("controllerd_config_reloads_total", outcome="ok") == 1
        await daemon.add_hot_topic(30_000.0)

        async def split() -> bool:
            return daemon.splits() == 1

        await wait_until(split, within=10)
        request = next(r for r in daemon.broker.requests if "/split/" in r.path)
        assert request.headers["authorization"] == "Bearer new-token"


def test_reference_config_is_the_defaults_and_every_key_a_setting() -> None:
    """The issue's contract, kept next to the others (tests/test_config.py goes further)."""
    assert config_mod.load_file(REFERENCE_CONFIG) == config_mod.Config()
    parsed = tomllib.loads(REFERENCE_CONFIG.read_text(encoding="utf-8"))

    def keys(table: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
        for k, v in table.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k]

    model = config_mod.to_dict(config_mod.Config())
    assert set(keys(parsed)) == set(keys(model))
