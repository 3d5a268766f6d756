"""``controllerd run`` as real processes: election, events, failover, SIGHUP, SIGTERM."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from controllerd.adapters.store import Store
from controllerd.core.model import Layout, TopicName
from controllerd.core.view import Keys
from controllerd.daemon.runtime import GcClock
from tests.support.broker import (
    TestBrokerState,
    layout_json,
    load_json,
    mirror_into,
    serve_test_broker,
)
from tests.support.daemon import Replica, replicas, wait_until, write_config
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port
from tests.test_demo_signals import signal_set

TOPIC = TopicName("acme", "ns", "orders")


@dataclass
class Cluster:
    replicas: list[Replica]
    broker: TestBrokerState
    store: Store
    keys: Keys
    tmp: Path

    async def leader(self) -> Replica:
        await wait_until(self._one_leads)
        for replica in self.replicas:
            if replica.alive() and await replica.is_leader():
                return replica
        raise AssertionError("the leader stepped down while we looked")

    async def _one_leads(self) -> bool:
        return sum([await r.is_leader() for r in self.replicas if r.alive()]) == 1

    def splits(self) -> int:
        return sum(1 for r in self.broker.requests if "/split/" in r.path)

    async def add_topic(self, segments: int = 1) -> Layout:
        layout = self.broker.add_topic(TOPIC, segments)
        await self.store.put(self.keys.layout(TOPIC), layout_json(layout))
        return layout

    async def put_load(self, segment_id: int, msg_in: float) -> None:
        await self.store.put(self.keys.load(TOPIC, segment_id), load_json(msg_in))


@pytest.fixture
async def cluster(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> AsyncIterator[Cluster]:
    keys = Keys(f"{etcd_prefix}pulsar", f"{etcd_prefix}controllerd/default")
    state = TestBrokerState(profile="reference")

    state.on_layout_change = mirror_into(store, keys)
    async with (
        serve_test_broker(state) as url,
        replicas(
            tmp_path, 2, etcd=etcd_server.endpoint, prefix=etcd_prefix, broker_url=url
        ) as running,
    ):
        yield Cluster(running, state, store, keys, tmp_path)


async def test_one_replica_leads_and_a_consumer_registration_splits(cluster: Cluster) -> None:
    leader = await cluster.leader()
    standby = next(r for r in cluster.replicas if r is not leader)
    status = await leader.status()
    assert status is not None and status["fencing_token"] > 0
    # how long the loop stalled at worst, and at most how much of that was its own CPU
    assert 0 <= status["max_loop_stall_on_cpu_s"] <= status["max_loop_stall_s"]
    standby_status = await standby.status()
    assert standby_status is not None and not standby_status["leader"]
    await wait_until(lambda: _sees_leader(standby, status["fencing_token"]))

    proc = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [sys.executable, "-m", "controllerd.cli", "status", "--config", str(standby.config)],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed["fencing_token"] == status["fencing_token"]
    assert printed["leader"]["replica"] == status["replica"]

    await cluster.add_topic(segments=1)
    await cluster.store.put(cluster.keys.subscription(TOPIC, "s"), b'{"type": "STREAM"}')
    for name in ("c1", "c2", "c3"):
        await cluster.store.put(cluster.keys.consumer(TOPIC, "s", name), b"{}")

    async def split_into_three() -> bool:
        return len(cluster.broker.topics[TOPIC].active_segments()) == 3

    await wait_until(split_into_three, within=10)
    assert cluster.splits() == 1
    split = next(r for r in cluster.broker.requests if "/split/" in r.path)
    assert split.headers["x-fencing-token"] == str(status["fencing_token"])


async def _sees_leader(replica: Replica, token: int) -> bool:
    status = await replica.status()
    return status is not None and status["current_token"] == token


async def test_sigterm_hands_over_at_once(cluster: Cluster) -> None:
    leader = await cluster.leader()
    standby = next(r for r in cluster.replicas if r is not leader)
    started = time.monotonic()
    leader.signal(signal.SIGTERM)
    took = await wait_until(standby.is_leader, within=10)
    print(f"\nSIGTERM handover: {took * 1000:.0f} ms")
    assert await anyio.to_thread.run_sync(leader.wait, 15.0) == 0
    exited = time.monotonic() - started
    print(f"leader exited after {exited * 1000:.0f} ms")
    # The standby won because the old leader deleted the key, not because a lease expired.
    won = [e for e in standby.log_events() if e.get("event") == "election.won"]
    assert won and won[-1]["after"] == "key-deleted"
    resigned = [e for e in leader.log_events() if e.get("event") == "election.resigned"]
    assert resigned and resigned[-1]["deleted_key"] is True


async def test_kill_9_of_the_leader_fails_over_within_the_lease_ttl(cluster: Cluster) -> None:
    leader = await cluster.leader()
    old = await leader.status()
    assert old is not None
    standby = next(r for r in cluster.replicas if r is not leader)
    leader.signal(signal.SIGKILL)
    took = await wait_until(standby.is_leader, within=10)
    print(f"\nkill -9 failover: {took * 1000:.0f} ms (lease TTL 2 s)")
    new = await standby.status()
    assert new is not None and new["fencing_token"] > old["fencing_token"]
    # the new leader acts
    await cluster.add_topic(segments=1)
    await cluster.put_load(0, 30_000.0)

    async def split() -> bool:
        return cluster.splits() == 1

    await wait_until(split, within=10)
    request = next(r for r in cluster.broker.requests if "/split/" in r.path)
    assert request.headers["x-fencing-token"] == str(new["fencing_token"])


async def test_sighup_reloads_a_valid_config_and_keeps_the_old_on_an_invalid_one(
    cluster: Cluster,
) -> None:
    leader = await cluster.leader()
    original = leader.config.read_text(encoding="utf-8")
    await cluster.add_topic(segments=1)
    await cluster.put_load(0, 5_000.0)  # in the dead band at the default thresholds

    async def decided() -> bool:
        return (
            await leader.metric("controllerd_decisions_total", action="none", reason="balanced")
            or 0
        ) >= 1

    await wait_until(decided)
    assert await leader.metric("controllerd_config_last_reload_successful") == 1
    leader.config.write_text(original + "\n[policy]\nmin_segments = 0\n", encoding="utf-8")
    leader.signal(signal.SIGHUP)

    async def rejected() -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="invalid")) == 1

    await wait_until(rejected)
    assert leader.alive() and cluster.splits() == 0
    assert await leader.metric("controllerd_config_last_reload_successful") == 0
    events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
    assert any("policy.min_segments" in err for err in events[-1]["errors"])

    leader.config.write_text(
        original + "\n[policy.split_thresholds]\nmsg_rate_in = 2000\n", encoding="utf-8"
    )
    leader.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="ok")) == 1

    await wait_until(reloaded)
    assert await leader.metric("controllerd_config_last_reload_successful") == 1
    await cluster.put_load(0, 5_001.0)  # the new threshold applies to the next evaluation

    async def split() -> bool:
        return cluster.splits() == 1

    await wait_until(split, within=10)
    assert len(cluster.broker.topics[TOPIC].active_segments()) == 3


async def test_sighup_keeps_restart_only_settings_until_a_restart(cluster: Cluster) -> None:
    """A reload used to put restart-only values in force while logging that it did not."""
    leader = await cluster.leader()
    original = leader.config.read_text(encoding="utf-8")
    leader.config.write_text(
        original + '\n[cluster]\nname = "renamed"\n[policy.split_thresholds]\nmsg_rate_in = 2000\n',
        encoding="utf-8",
    )
    leader.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="ok")) == 1

    await wait_until(reloaded)
    warned = [e for e in leader.log_events() if e.get("event") == "config.restart_required"]
    assert warned and warned[-1]["settings"] == ["cluster.name"]
    status = await leader.status()
    assert status is not None and status["cluster"] == "default"
    await cluster.add_topic(segments=1)
    await cluster.put_load(0, 5_000.0)  # over the reloaded 2000 msg/s, under the default

    async def split() -> bool:
        return cluster.splits() == 1

    await wait_until(split, within=10)


async def test_sigterm_stops_a_replica_still_waiting_for_etcd_to_authenticate(
    tmp_path: Path,
) -> None:
    """With ``etcd.username`` set, SIGTERM during an etcd outage at start used to be logged
    and ignored: only the stopper, which starts once etcd answers, acted on it."""
    password = tmp_path / "etcd-password"
    password.write_text("secret\n", encoding="utf-8")
    config = write_config(
        tmp_path / "replica.toml",
        etcd=f"http://127.0.0.1:{free_port()}",  # nothing listens there
        prefix="/t/",
        broker_url="http://127.0.0.1:1",
        port=free_port(),
    )
    text = config.read_text(encoding="utf-8")
    config.write_text(
        text.replace("[etcd]\n", f'[etcd]\nusername = "root"\npassword_file = "{password}"\n', 1),
        encoding="utf-8",
    )
    replica = Replica("r0", config, 0, tmp_path / "replica.log")
    replica.start()
    try:

        async def retrying() -> bool:
            return any(e.get("event") == "etcd.unavailable" for e in replica.log_events())

        await wait_until(retrying)
        replica.signal(signal.SIGTERM)
        # Less than one attempt lasts (the store retries for 5 s): the attempt is cut short.
        assert await anyio.to_thread.run_sync(replica.wait, 4.0) == 0
    finally:
        with anyio.CancelScope(shield=True):
            await replica.stop()
    stopped = [e for e in replica.log_events() if e.get("event") == "daemon.stopped"]
    assert stopped and stopped[-1]["exit_code"] == 0


async def test_a_bad_token_file_on_sighup_is_refused_and_the_daemon_lives_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A token file rewritten as two lines used to end the daemon with an internal error."""
    leader = await cluster.leader()
    token = tmp_path / "token"
    token.write_text("t0ken\n", encoding="utf-8")
    original = leader.config.read_text(encoding="utf-8")
    leader.config.write_text(
        original.replace("[broker]\n", f'[broker]\ntoken_file = "{token}"\n', 1), encoding="utf-8"
    )
    leader.signal(signal.SIGHUP)

    async def reloads(outcome: str, count: int) -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome=outcome)) == count

    await wait_until(lambda: reloads("ok", 1))
    for rejected, (content, problem) in enumerate(
        ((b"t0k\nen\n", "must hold one line"), (b"", "is empty")), start=1
    ):
        token.write_bytes(content)
        leader.signal(signal.SIGHUP)
        await wait_until(functools.partial(reloads, "invalid", rejected))
        events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
        assert problem in events[-1]["errors"][0] and "broker.token_file" in events[-1]["errors"][0]
        assert leader.alive()
    # A restart-only file is checked too: the next restart must not be the first to say so.
    token.write_bytes(b"t0ken\n")
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n", encoding="utf-8")
    leader.config.write_text(
        original.replace(
            "[broker]\n", f'[broker]\ntoken_file = "{token}"\nca_file = "{garbage}"\n', 1
        ),
        encoding="utf-8",
    )
    leader.signal(signal.SIGHUP)
    await wait_until(functools.partial(reloads, "invalid", 3))
    events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
    assert "broker.ca_file" in events[-1]["errors"][0] and "not a PEM CA bundle" in str(events[-1])
    assert leader.alive()


async def test_a_config_or_secret_that_is_a_pipe_or_device_on_sighup_is_refused_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Opening a FIFO blocks until a writer comes and ``/dev/zero`` never ends: read on
    SIGHUP, either froze the event loop (or filled the memory). Both are refused at
    once, and the replica goes on leading."""
    leader = await cluster.leader()
    original = leader.config.read_text(encoding="utf-8")

    async def rejected(count: int) -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="invalid")) == count

    leader.config.write_text(
        original.replace("[broker]\n", '[broker]\ntoken_file = "/dev/zero"\n', 1),
        encoding="utf-8",
    )
    leader.signal(signal.SIGHUP)
    await wait_until(functools.partial(rejected, 1))
    events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
    assert "broker.token_file" in events[-1]["errors"][0]
    assert "not a regular file" in events[-1]["errors"][0]
    leader.config.unlink()
    os.mkfifo(leader.config)
    leader.signal(signal.SIGHUP)
    await wait_until(functools.partial(rejected, 2))
    events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
    assert "not a regular file" in events[-1]["errors"][0]
    assert leader.alive() and await leader.is_leader()  # the loop answers: nothing blocked


async def test_an_empty_config_on_sighup_is_refused_and_the_old_one_kept(
    cluster: Cluster,
) -> None:
    """#10 item 6: an empty file used to reset every reloadable setting to its default."""
    leader = await cluster.leader()
    original = leader.config.read_text(encoding="utf-8")
    leader.config.write_text(
        original + "\n[policy.split_thresholds]\nmsg_rate_in = 2000\n", encoding="utf-8"
    )
    leader.signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="ok")) == 1

    await wait_until(reloaded)
    leader.config.write_text("# truncated by a failed deploy\n", encoding="utf-8")
    leader.signal(signal.SIGHUP)

    async def rejected() -> bool:
        return (await leader.metric("controllerd_config_reloads_total", outcome="invalid")) == 1

    await wait_until(rejected)
    events = [e for e in leader.log_events() if e.get("event") == "config.reload.rejected"]
    assert "empty" in events[-1]["errors"][0]
    # The 2000 msg/s threshold of the last good config still applies (the default is 10000).
    await cluster.add_topic(segments=1)
    await cluster.put_load(0, 5_000.0)

    async def split() -> bool:
        return cluster.splits() == 1

    await wait_until(split, within=10)
    assert leader.alive()


def test_the_loop_monitor_times_the_garbage_collector() -> None:
    """``loop.stalled`` says how much of a stall was the collector (issue #12's stalls)."""
    before = len(gc.callbacks)
    with GcClock() as collector:
        junk: list[object] = []
        junk.append(junk)  # a cycle, so there is something to collect
        del junk
        gc.collect()
        assert collector.seconds > 0
    assert len(gc.callbacks) == before


def test_a_reload_that_fails_unexpectedly_is_refused_and_the_old_config_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever judging the new file raises, SIGHUP keeps the previous config: a reload
    must never take the daemon down (the known failures are ConfigErrors; this is the
    catch-all behind them)."""
    from controllerd import config as config_mod
    from controllerd.daemon.metrics import Metrics
    from controllerd.daemon.runtime import Daemon

    path = unreachable_config(tmp_path)
    metrics = Metrics()
    daemon = Daemon(str(path), {}, metrics=metrics)
    before = daemon.config

    def broken(*_: object, **__: object) -> config_mod.Config:
        raise RuntimeError("a bug in the loader")

    monkeypatch.setattr(config_mod, "load_file", broken)
    assert daemon.reload() is False
    assert daemon.config is before
    assert metrics.config_reloads.labels(outcome="invalid")._value.get() == 1
    assert metrics.operator_errors.labels(kind="config-reload")._value.get() == 1


def test_a_reload_tells_the_controller_so_its_tickers_measure_again(tmp_path: Path) -> None:
    """A lowered ``[autoscale]``/``[gc]`` interval applied only once the old one ran out
    (600 s lowered to 1 s: no tick for up to 600 s): the reload must wake the tickers."""
    from controllerd.daemon.metrics import Metrics
    from controllerd.daemon.runtime import Daemon

    path = unreachable_config(tmp_path)
    daemon = Daemon(str(path), {}, metrics=Metrics())

    class Told:
        times = 0

        def reconfigured(self) -> None:
            self.times += 1

    told = Told()
    daemon._controller = told  # type: ignore[assignment]  # only the reload hook is used
    assert daemon.reload() is True
    assert told.times == 1


def unreachable_config(tmp_path: Path) -> Path:
    """A config whose etcd and broker never answer: for a Daemon driven by hand."""
    return write_config(
        tmp_path / "c.toml",
        etcd="http://127.0.0.1:1",
        prefix="/t/",
        broker_url="http://127.0.0.1:1",
        port=free_port(),
    )


def _lone_replica(tmp_path: Path, etcd: str, prefix: str) -> Replica:
    port = free_port()
    config = write_config(
        tmp_path / "replica.toml",
        etcd=etcd,
        prefix=prefix,
        broker_url="http://127.0.0.1:9",
        port=port,
    )
    return Replica("r0", config, port, tmp_path / "replica.log")


def _catches(replica: Replica, sig: signal.Signals) -> bool:
    """Whether the replica's process has a handler for ``sig`` (False once it exited)."""
    assert replica.proc is not None
    try:
        return sig in signal_set(replica.proc.pid, "SigCgt")
    except OSError:  # exited, and reaped
        return False


async def test_a_sighup_while_the_daemon_starts_does_not_end_it(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """SIGHUP's default action ends a process, and the daemon listened for it only once
    its modules were imported and its loop ran, a second after it started: a reload
    asked for meanwhile (``systemctl reload``, a config-map watcher) killed it. ``run``
    now catches SIGHUP before it imports the daemon."""
    replica = _lone_replica(tmp_path, etcd_server.endpoint, etcd_prefix)
    replica.start()
    try:

        async def catches_sighup() -> bool:
            assert replica.alive(), replica.log_path.read_text(encoding="utf-8")
            return _catches(replica, signal.SIGHUP)

        await wait_until(catches_sighup, step=0.002)
        # caught while the daemon's modules are still being imported
        assert not [e for e in replica.log_events() if e.get("event") == "daemon.starting"]
        replica.signal(signal.SIGHUP)
        await wait_until(replica.ready, within=30)
        assert replica.alive()
        assert await replica.metric("controllerd_config_last_reload_successful") == 1
    finally:
        with anyio.CancelScope(shield=True):
            await replica.stop()
    assert replica.proc is not None and replica.proc.returncode == 0


@contextlib.contextmanager
def _notifications(directory: Path) -> Iterator[tuple[dict[str, str], Callable[[], list[str]]]]:
    """A systemd notification socket: its environment, and what was sent to it so far."""
    path = directory / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.setblocking(False)
        sent: list[str] = []

        def received() -> list[str]:
            with contextlib.suppress(BlockingIOError):
                while True:
                    sent.append(sock.recv(4096).decode())
            return sent

        yield {"NOTIFY_SOCKET": str(path)}, received


async def test_a_sighup_after_the_config_is_read_reloads_once_the_daemon_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGHUP caught early (``early_hangups``) before the daemon read its config asks
    for nothing more than that read; one after it, for a reload as soon as the daemon
    listens for signals, which tells systemd nothing: ``READY=1`` before the daemon is
    ready would end its start-up. When the daemon stops listening, SIGHUP is ignored,
    not given back its default action (which ends the process)."""
    from controllerd.daemon.metrics import Metrics
    from controllerd.daemon.runtime import Daemon

    path = unreachable_config(tmp_path)
    original = signal.getsignal(signal.SIGHUP)
    hangups = 0

    async def reloads_when_it_listens(daemon: Daemon, metrics: Metrics) -> float:
        """The config reloads done once the reloader listens; after it, SIGHUP is ignored."""
        before = signal.getsignal(signal.SIGHUP)

        async def listening() -> bool:
            return signal.getsignal(signal.SIGHUP) is not before

        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon._reloader)
            await wait_until(listening)  # the early check is done at once, then it waits
            done: float = metrics.config_reloads.labels(outcome="ok")._value.get()
            tg.cancel_scope.cancel()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        return done

    try:
        hangups += 1  # before the read: answered by it
        metrics = Metrics()
        daemon = Daemon(str(path), {}, metrics=metrics, early_hangups=lambda: hangups)
        assert await reloads_when_it_listens(daemon, metrics) == 0

        metrics = Metrics()
        daemon = Daemon(str(path), {}, metrics=metrics, early_hangups=lambda: hangups)
        with path.open("a", encoding="utf-8") as config:
            config.write("[policy.split_thresholds]\nmsg_rate_in = 2000\n")
        hangups += 2  # after the read: one reload, however many came
        with _notifications(tmp_path) as (env, received):
            monkeypatch.setenv("NOTIFY_SOCKET", env["NOTIFY_SOCKET"])
            assert await reloads_when_it_listens(daemon, metrics) == 1
            assert received() == []
        assert daemon.config.policy.split_thresholds.msg_rate_in == 2000
    finally:
        signal.signal(signal.SIGHUP, original)


async def test_a_sighup_during_the_shutdown_neither_reloads_nor_ends_the_daemon(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """A SIGHUP right after SIGTERM reloaded (systemd heard RELOADING=1, READY=1 after
    STOPPING=1), and once the daemon stopped listening for signals, one ended it
    (killed by SIGHUP, not exit 0) before its shutdown was done."""
    replica = _lone_replica(tmp_path, etcd_server.endpoint, etcd_prefix)
    with _notifications(tmp_path) as (env, received):
        replica.env.update(env)
        replica.start()
        try:
            await wait_until(replica.ready, within=30)

            async def announced() -> bool:
                return "READY=1" in received()

            await wait_until(announced)
            replica.signal(signal.SIGTERM)

            async def stopping() -> bool:
                return "STOPPING=1" in received()

            await wait_until(stopping)
            replica.signal(signal.SIGHUP)  # while it still listens, stopping

            async def stopped_listening() -> bool:
                return not _catches(replica, signal.SIGHUP)

            await wait_until(stopped_listening, step=0.001)
            if replica.alive():
                replica.signal(signal.SIGHUP)  # after it stopped listening
            code = await anyio.to_thread.run_sync(replica.wait, 15.0)
        finally:
            with anyio.CancelScope(shield=True):
                await replica.stop()
        sent = received()
    assert code == 0
    stopped = sent.index("STOPPING=1")
    after = [m for m in sent[stopped:] if m.startswith(("RELOADING=1", "READY=1"))]
    assert after == [], sent
    events = [e.get("event") for e in replica.log_events()]
    assert "config.reloaded" not in events and "daemon.stopped" in events
