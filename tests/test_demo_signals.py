"""``controllerd demo`` as a process: how it ends, and what its children inherit.

The demo starts etcd, tansu, the reference broker and two replicas, each in a
session of its own, so nothing but the demo stops them: however it ends (SIGTERM,
SIGHUP when the terminal closes, a child that dies at start-up) it must stop them
all and remove its work directory. Each test runs the real demo in a
pseudo-terminal, with its work directory under ``tmp_path`` (``TMPDIR``), and
finds the children as the processes whose parent is the demo. Getting all five
listening takes a few seconds; the story itself is never waited for.
"""

from __future__ import annotations

import contextlib
import os
import pty
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from controllerd.errors import DEBUG_ENV, EXIT_OK, EXIT_UNAVAILABLE
from tests.test_refbroker_cli import Output, run

DEMO = [sys.executable, "-m", "controllerd.cli", "demo"]
#: etcd, tansu, the reference broker and two replicas.
CHILDREN = 5
#: Seconds the demo gets to have every child listening (a few on a busy 2-core runner).
START_TIMEOUT = 60.0
#: Seconds the demo gets to stop its children and exit (it gives them 15 before SIGKILL).
STOP_TIMEOUT = 30.0


@dataclass
class Demo:
    """A running demo: its process, its terminal (``out``), work directory and children."""

    proc: subprocess.Popen[bytes]
    out: Output
    root: Path
    children: list[int]
    hung_up: bool = False

    def hang_up(self) -> None:
        """Close the terminal, as a closed window does: the demo's writes then fail (EIO)."""
        os.close(self.out.fd)
        self.hung_up = True

    def exited(self) -> int:
        """The demo's exit status, once it exited (within STOP_TIMEOUT)."""
        return self.proc.wait(timeout=STOP_TIMEOUT)

    def running_children(self) -> list[int]:
        return [pid for pid in self.children if running(pid)]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children_of(parent: int) -> list[int]:
    """The processes whose parent is ``parent`` (from /proc: no psutil needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8")
        except OSError:  # it exited meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def signal_set(pid: int, field: str) -> set[signal.Signals]:
    """The signals in the ``SigIgn`` or ``SigCgt`` (caught) mask of /proc/<pid>/status."""
    status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:")]
    return {sig for sig in signal.Signals if int(mask, 16) >> (sig - 1) & 1}


@contextlib.contextmanager
def started_demo(
    tmp_path: Path, env: dict[str, str] | None = None, argv: list[str] = DEMO
) -> Iterator[Demo]:
    """``argv`` (the demo) once every child listens; on the way out, whatever the test
    left running (the demo, its children) is killed, so a failing test leaks nothing."""
    terminal, device = pty.openpty()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=device,
        stderr=device,
        env={**os.environ, "TMPDIR": str(tmp_path), **(env or {})},
    )
    os.close(device)
    out = Output(terminal)
    demo: Demo | None = None
    children: list[int] = []
    try:
        root = Path(out.until(r"logs in (\S+?)\r?$", START_TIMEOUT).group(1))
        children = children_of(proc.pid)
        assert len(children) == CHILDREN, out.text
        demo = Demo(proc, out, root, children)
        yield demo
    finally:
        children = children or children_of(proc.pid)  # it failed to start them all
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if demo is None or not demo.hung_up:
            os.close(terminal)


def test_sigterm_stops_every_child_and_removes_the_work_dir(tmp_path: Path) -> None:
    """SIGTERM used to end the demo at once, leaving all five children running."""
    with started_demo(tmp_path) as demo:
        assert {signal.SIGTERM, signal.SIGHUP} <= signal_set(demo.proc.pid, "SigCgt")
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.exited() == EXIT_OK
        assert demo.running_children() == []
        assert not demo.root.exists()
        output = demo.out.rest()
    assert "SIGTERM: stopping the demo" in output
    assert "stopping processes" in output


def test_a_hang_up_stops_every_child_though_the_terminal_is_gone(tmp_path: Path) -> None:
    """As when the terminal window is closed: SIGHUP, and every write to it fails (EIO)."""
    with started_demo(tmp_path) as demo:
        demo.hang_up()
        demo.proc.send_signal(signal.SIGHUP)
        demo.exited()  # its status does not matter: nobody is there to see it
        assert demo.running_children() == []
        assert not demo.root.exists()


def test_a_hang_up_ignored_as_under_nohup_stays_ignored(tmp_path: Path) -> None:
    """``nohup controllerd demo &`` keeps running when the terminal closes; SIGTERM stops it.

    The kernel's own record of the demo's signal dispositions says it, with no
    wait: SIGHUP stays ignored while SIGTERM is caught.
    """
    nohup = [
        sys.executable,
        "-c",
        "import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "from controllerd.cli import main; sys.exit(main(['demo']))",
    ]
    with started_demo(tmp_path, argv=nohup) as demo:
        assert signal.SIGHUP in signal_set(demo.proc.pid, "SigIgn")
        assert signal.SIGTERM in signal_set(demo.proc.pid, "SigCgt")
        demo.proc.send_signal(signal.SIGHUP)
        demo.proc.send_signal(signal.SIGTERM)
        assert demo.exited() == EXIT_OK
        assert demo.running_children() == []
        output = demo.out.rest()
    assert "SIGTERM: stopping the demo" in output
    assert "SIGHUP" not in output


def test_children_inherit_no_controllerd_variable_but_debug(tmp_path: Path) -> None:
    """An exported ``CONTROLLERD_ETCD__ENDPOINTS`` would point the demo's replicas at real
    infrastructure; they take their settings from the files the demo writes."""
    env = {
        "CONTROLLERD_CLUSTER__NAME": "prod",
        "CONTROLLERD_ETCD__ENDPOINTS": '["http://127.0.0.1:9"]',
        DEBUG_ENV: "1",
    }
    with started_demo(tmp_path, env=env) as demo:
        for pid in demo.children:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
            assert {n for n in names if n.startswith("CONTROLLERD_")} == {DEBUG_ENV}, pid
        demo.proc.send_signal(signal.SIGTERM)
        demo.exited()


def test_a_child_that_exits_at_start_up_is_one_line_naming_its_log(tmp_path: Path) -> None:
    """It used to take 30 s and end as ``internal error: TimeoutError`` (70)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "etcd"
    fake.write_text("#!/bin/sh\necho 'etcd: bad flag' >&2\nexit 1\n", encoding="utf-8")
    fake.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    done = run(DEMO, env={"PATH": path, "TMPDIR": str(tmp_path)}, timeout=20)
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    [root] = tmp_path.glob("controllerd-demo-*")  # kept: the line names a log in it
    log = root / "etcd.log"
    assert done.stderr.splitlines() == [f"controllerd: etcd exited with 1; see {log}"]
    assert log.read_text(encoding="utf-8") == "etcd: bad flag\n"
