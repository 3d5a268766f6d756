"""Ready means etcd answered and the replica campaigns or leads (issue #10 item 5).

Real ``controllerd run`` processes: before this, /readyz said 200 and systemd got
READY=1 without etcd ever answering (the store connects lazily), also against a
TLS etcd the daemon had no client certificate for.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from controllerd import config as config_mod
from controllerd.adapters.store import Store
from controllerd.core.view import Keys
from tests.support.daemon import Replica, wait_until, write_config
from tests.support.etcd import EtcdServer, make_pki
from tests.support.kafka import free_port
from tests.support.notify import notify_socket


def _replica(tmp: Path, etcd: str, prefix: str, extra: str = "") -> Replica:
    port = free_port()
    config = write_config(
        tmp / "replica.toml",
        etcd=etcd,
        prefix=prefix,
        broker_url="http://127.0.0.1:9",
        port=port,
        extra=extra,
    )
    return Replica("r0", config, port, tmp / "replica.log")


async def _reason(replica: Replica) -> str | None:
    response = await replica.get("/readyz")
    if response is None or response.status_code != 503:
        return None
    reason: str | None = response.json().get("reason")
    return reason


async def test_not_ready_until_etcd_answers_then_ready_and_status_says_why(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    etcd_server.pause()  # etcd is there but answers nothing, as after a crash of its host
    replica = _replica(tmp_path, etcd_server.endpoint, etcd_prefix)
    try:
        with notify_socket(tmp_path) as notify:
            replica.env.update(notify.env)
            replica.start()

            async def waiting_for_etcd() -> bool:
                reason = await _reason(replica)
                return reason is not None and "etcd" in reason

            await wait_until(waiting_for_etcd, within=20)
            await notify.expect_where("STATUS", lambda text: "etcd" in text, within=10)
            assert not notify.times("READY")  # systemd is not told we are ready
            etcd_server.resume()
            await wait_until(replica.ready, within=20)
            await notify.expect("READY", within=10)
            status_after = (await replica.status()) or {}
            assert status_after["ready"] is True and status_after["leader"] is True
            # and not ready again while etcd stops answering, without exiting
            etcd_server.pause()
            await wait_until(waiting_for_etcd, within=20)
            assert replica.alive()
    finally:
        etcd_server.resume()
        await replica.stop()
    assert replica.proc is not None and replica.proc.returncode == 0


async def test_tls_etcd_without_a_client_certificate_is_not_ready(
    tmp_path: Path, etcd_prefix: str
) -> None:
    pki = make_pki(tmp_path / "pki")
    server = EtcdServer(tmp_path / "etcd", pki)
    await anyio.to_thread.run_sync(server.start)
    try:
        # the CA is trusted, but no client certificate: etcd refuses the handshake
        replica = _replica(tmp_path, server.endpoint, etcd_prefix)
        text = replica.config.read_text(encoding="utf-8")
        text = text.replace("[etcd]\n", f'[etcd]\nca_file = "{pki.ca}"\n', 1)
        replica.config.write_text(text, encoding="utf-8")
        replica.start()

        async def refused() -> bool:
            reason = await _reason(replica)
            return reason is not None and "etcd" in reason

        await wait_until(refused, within=20)
        assert replica.alive()
        replica.signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(replica.wait, 15.0) == 0
    finally:
        server.close()


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (b'{"replica":"\\ud800x","host":"h","pid":1}', "ud800x"),
        (b'{"replica":' + b'{"a":' * 1000 + b"1" + b"}" * 1001, '{"replica":{"a":{"a":'),
    ],
    ids=["surrogate", "nested"],
)
async def test_a_leader_identity_that_cannot_be_shown_leaves_a_standby_running(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    tmp_path: Path,
    store: Store,
    value: bytes,
    shown: str,
) -> None:
    """Garbage in etcd never takes a replica down. A leader key whose JSON names the
    replica ``"\\ud800x"`` (a lone surrogate: valid JSON, not encodable text) reached
    systemd's STATUS= line on every standby and ended it with exit 70; so did a name
    nested a thousand deep (formatting it raised RecursionError)."""
    replica = _replica(tmp_path, etcd_server.endpoint, etcd_prefix)
    cfg = config_mod.load_file(replica.config)
    keys = Keys(cfg.metadata_prefix, cfg.controller_root)
    # no lease: this leader never goes, so the replica stays a standby throughout
    await store.put(keys.leader, value)
    try:
        with notify_socket(tmp_path) as notify:
            replica.env.update(notify.env)
            replica.start()
            await notify.expect("READY", within=20)
            statuses = [m["STATUS"] for m in notify.messages if "STATUS" in m]
            assert any("standing by" in s and shown in s for s in statuses), statuses
            await anyio.sleep(1.0)  # a few more status reports: none may end it
            assert replica.alive()
            assert (await replica.status() or {}).get("leader") is False
    finally:
        await replica.stop()
    assert replica.proc is not None and replica.proc.returncode == 0
