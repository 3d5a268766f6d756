"""``--master spark://HOST:7077``: a real standalone cluster, started from the pyspark package.

A master and a worker run on 127.0.0.1 (``spark-class ...deploy.master.Master`` and
``...deploy.worker.Worker``, as ``start-master.sh``/``start-worker.sh`` would run
them), in an environment where nothing puts this checkout on the executors' Python
path: the executors only get our code because the driver ships it. The console
command then backtests CSV series and a recorded history (read by the executors
from its path) and must write the same ``metrics.csv`` as the local engine; the
history, its trace with the most excess load, is then replayed again for its plots.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from controllerd.pipeline.engines import QUIET_LOG4J2, RATE_COLUMNS
from controllerd.pipeline.history import LOADS, write_rows
from tests.support.spark import QUICK_JVM

ROOT: Final = Path(__file__).resolve().parent.parent
T0: Final = 1_420_070_400_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> None:
    """Poll an outcome in another process (never a timed assertion about speed)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pyspark = pytest.importorskip("pyspark")
    spark_home = Path(pyspark.__file__).resolve().parent
    work = tmp_path_factory.mktemp("spark-standalone")
    conf = work / "conf"
    conf.mkdir()
    (conf / "log4j2.properties").write_text(QUIET_LOG4J2, encoding="utf-8")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(work),
        "SPARK_HOME": str(spark_home),
        "SPARK_CONF_DIR": str(conf),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false",
        # The master and worker daemons only start the executor here: the quick JIT tier
        # and a serial collector spare the cores the rest of the suite shares.
        "SPARK_DAEMON_JAVA_OPTS": QUICK_JVM,
        # The executor's JVM, which the worker starts with its own environment.
        "JAVA_TOOL_OPTIONS": QUICK_JVM,
    }
    if "JAVA_HOME" in os.environ:
        env["JAVA_HOME"] = os.environ["JAVA_HOME"]
    port, ui = free_port(), free_port()
    url = f"spark://127.0.0.1:{port}"
    spark_class = str(spark_home / "bin" / "spark-class")
    logs = {name: (work / f"{name}.log").open("w") for name in ("master", "worker")}
    master = subprocess.Popen(
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
         "--port", str(port), "--webui-port", str(ui)],
        env=env, cwd=work, stdout=logs["master"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    worker: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _accepts(port), "the master to listen")
        worker = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
             "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()),
             "--work-dir", str(work / "work")],
            env=env, cwd=work, stdout=logs["worker"], stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(lambda: _alive_workers(ui) >= 1, "the worker to register with the master")
        yield url
    finally:
        for proc in (worker, master):
            if proc is not None:
                proc.terminate()
        for proc in (worker, master):
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for fh in logs.values():
            fh.close()


def _alive_workers(ui: int) -> int:
    """The master's own count of live workers, from its web UI's JSON view."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as resp:
            return int(json.load(resp).get("aliveworkers", 0))
    except (OSError, ValueError):
        return 0


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def controllerd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The driver runs this checkout; its JVM too is a short-lived one.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAVA_TOOL_OPTIONS": QUICK_JVM}
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    return subprocess.run(
        [sys.executable, "-m", "controllerd.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def inputs(tmp: Path) -> tuple[Path, Path]:
    series = tmp / "series"
    series.mkdir()
    for name, period in (("bursty", 37), ("calm", 90)):
        with (series / f"{name}.csv").open("w", encoding="utf-8") as fh:
            fh.write("timestamp,value\n")
            for i in range(12 * 36):
                value = 900 if i % period == 5 else 20 + 10 * ((i * 7) % 5)
                fh.write(f"{1_420_070_400 + 300 * i},{value}\n")
    history = tmp / "history"
    rows: list[dict[str, Any]] = []
    for minute in range(0, 600, 5):
        for segment, (start, end) in enumerate(((0, 0x7FFF), (0x8000, 0xFFFF))):
            rate = 40_000.0 if 200 <= minute < 320 and segment == 0 else 400.0 + minute
            row: dict[str, Any] = dict.fromkeys(RATE_COLUMNS, rate)
            row |= {
                "topic": "acme/ns/orders",
                "t_ms": T0 + minute * 60_000,
                "observed_at_ms": T0 + minute * 60_000,
                "mod_revision": minute * 2 + segment,
                "segment_id": segment,
                "range_start": start,
                "range_end": end,
                "changed_at_ms": T0 + minute * 60_000,
                "hash_buckets": [1.0, 3.0] if segment == 0 else None,
            }
            rows.append(row)
    write_rows(history, LOADS, rows)
    return series, history


def read_metrics(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def test_a_standalone_cluster_gives_the_local_engines_metrics(
    standalone: str, tmp_path: Path
) -> None:
    series, history = inputs(tmp_path)
    common = ["--traces", str(series), str(history), "--no-progress"]
    local = controllerd(
        "backtest", *common, "--no-plots", "--out", str(tmp_path / "local"), cwd=tmp_path
    )
    assert local.returncode == 0, local.stderr
    remote = controllerd(
        "backtest",
        *common,
        "--plot-traces",
        "1",
        "--engine",
        "spark",
        "--master",
        standalone,
        "--out",
        str(tmp_path / "cluster"),
        cwd=tmp_path,
    )
    assert remote.returncode == 0, remote.stderr
    ours = read_metrics(tmp_path / "local" / "metrics.csv")
    theirs = read_metrics(tmp_path / "cluster" / "metrics.csv")
    assert ours == theirs  # same rows, same order, same digits
    assert {r["trace"] for r in ours} == {"bursty", "calm", "acme/ns/orders"}
    assert sum(int(r["splits"]) for r in ours) > 0
    # The trace with the most excess load, the recorded history, was replayed again by
    # the executors (that topic's rows only) for its plots.
    excess = {
        t: sum(float(r["excess_load"]) for r in ours if r["trace"] == t)
        for t in ("bursty", "calm", "acme/ns/orders")
    }
    assert max(excess, key=lambda t: excess[t]) == "acme/ns/orders"
    pngs = sorted(p.name for p in (tmp_path / "cluster" / "plots").glob("*.png"))
    assert pngs == ["acme_ns_orders-peak.png", "acme_ns_orders.png", "pareto.png"]
    report = (tmp_path / "cluster" / "report.md").read_text(encoding="utf-8")
    # The executors ran the shipped zip, not this checkout nor another installed copy.
    assert "executors run controllerd from " in report
    origin = report.split("executors run controllerd from ")[1].split(")")[0]
    assert "controllerd.zip" in origin and str(ROOT) not in origin
    # Spark's own chatter stays quiet: no WARN lines from the JVM.
    assert " WARN " not in remote.stderr
