"""One local SparkSession per test run (cold start ~7 s; DESIGN §7).

Python workers run on this interpreter (``PYSPARK_PYTHON=sys.executable``), on
loopback, with two cores, few shuffle partitions and no UI, so the session is
as small and fast as Spark gets; its JVM logs errors only, like the backtest's, and
compiles with C1 alone (the tests' queries are small).
Spark tests take the ``spark`` fixture::

    from tests.support.spark import spark_fixture  # noqa: F401 - fixture

    def test_x(spark: SparkSession) -> None: ...
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""For JVMs that live for a few small tests: C1 only and one collector thread take about
a third less CPU than the C2 compiles and parallel collector of the defaults."""


@pytest.fixture(name="spark", scope="session")
def spark_fixture() -> Iterator[SparkSession]:
    pytest.importorskip("pyspark", reason="the spark extra is not installed")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    # As spark_session() does: py4j's connections log at INFO when the interpreter
    # collects them, after pytest has closed the streams ("--- Logging error ---").
    logging.getLogger("py4j").setLevel(logging.ERROR)
    from pyspark.sql import SparkSession

    from controllerd.pipeline.engines import quiet_log4j2

    java_options = f"-Dlog4j2.configurationFile={quiet_log4j2()} {QUICK_JVM}"
    builder: Any = SparkSession.builder
    session: SparkSession = (
        builder.master("local[2]")
        .appName("controllerd-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "1g")
        .config("spark.driver.extraJavaOptions", java_options)
        .config("spark.executor.extraJavaOptions", java_options)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


spark = spark_fixture
