"""``controllerd status`` on a real etcd: leader, no leader, etcd down, refused, sharded.

The command runs as a process (``python -m controllerd.cli status``), so what is
asserted is what an operator sees: stdout, exactly one stderr line, the status.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.to_thread
import pytest
from etcd3aio import Etcd3Client

from controllerd import config as config_mod
from controllerd.adapters.store import KeyValue, Store
from controllerd.core.shards import shard_name
from controllerd.daemon import status as status_mod
from controllerd.errors import EXIT_UNAVAILABLE, OperatorError
from tests.support.etcd import EtcdServer
from tests.support.kafka import free_port
from tests.test_cli import cli, one_line


def write(tmp_path: Path, etcd: str, prefix: str, extra: str = "", etcd_extra: str = "") -> Path:
    path = tmp_path / "controllerd.toml"
    path.write_text(
        f'[etcd]\nendpoints = ["{etcd}"]\ncontroller_prefix = "{prefix}controllerd"\n'
        f'{etcd_extra}[cluster]\nname = "east"\n{extra}',
        encoding="utf-8",
    )
    return path


async def status(*argv: str) -> Any:
    return await anyio.to_thread.run_sync(lambda: cli("status", *argv))


async def test_no_leader_exits_1_with_one_line_and_the_json_contract(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    config = write(tmp_path, etcd_server.endpoint, etcd_prefix)
    proc = await status("--config", str(config))
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == {
        "cluster": "east",
        "mode": "single",
        "leader": None,
        "fencing_token": None,
    }
    line = one_line(proc)
    assert line.startswith("controllerd: cluster 'east' has no leader")
    assert f"{etcd_prefix}controllerd/east/leader" in line


async def test_leader_and_fencing_token_as_json_and_table(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store, tmp_path: Path
) -> None:
    config = write(tmp_path, etcd_server.endpoint, etcd_prefix)
    identity = {"replica": "replica-b", "host": "node-2", "pid": 4242}
    key = f"{etcd_prefix}controllerd/east/leader"
    await store.put(key, json.dumps(identity).encode())
    kv = await store.get(key)
    assert kv is not None
    proc = await status("--config", str(config), "-o", "json")
    assert (proc.returncode, proc.stderr) == (0, "")
    body = json.loads(proc.stdout)
    assert body["leader"] == identity and body["fencing_token"] == kv.create_revision
    proc = await status("--config", str(config), "-o", "table")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines() == [
        "cluster        east",
        "mode           single",
        "leader         replica-b (host node-2, pid 4242)",
        f"fencing token  {kv.create_revision}",
    ]
    # Not a terminal: the default is JSON, which scripts parse.
    proc = await status("--config", str(config))
    assert json.loads(proc.stdout) == body


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        # a lone surrogate: valid JSON, not encodable text (the table exited 70)
        (b'{"replica":"\\ud800x","host":"h","pid":1}', '{"replica":"\\ud800x"'),
        # a number beyond a double: Python reads it as inf, strict parsers reject Infinity
        (b'{"replica":"a","pid":1e999}', '{"replica":"a","pid":1e999}'),
        # an escape sequence written by anyone with write access: shown, not obeyed
        (b'{"replica":"a\\u001b[2Jb","host":"h"}', "a\\x1b[2Jb (host h)"),
    ],
    ids=["surrogate", "infinity", "escape"],
)
async def test_a_leader_identity_that_is_garbage_is_shown_as_text_and_json_stays_strict(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: Store,
    tmp_path: Path,
    value: bytes,
    shown: str,
) -> None:
    config = write(tmp_path, etcd_server.endpoint, etcd_prefix)
    await store.put(f"{etcd_prefix}controllerd/east/leader", value)
    table = await status("--config", str(config), "-o", "table")
    assert (table.returncode, table.stderr) == (0, ""), table.stderr
    leader_line = table.stdout.splitlines()[2]
    assert leader_line.startswith("leader") and shown in leader_line
    assert "\x1b" not in table.stdout
    proc = await status("--config", str(config), "-o", "json")
    assert (proc.returncode, proc.stderr) == (0, "")
    json.loads(proc.stdout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))


async def test_etcd_down_is_status_3_not_the_no_leader_status(tmp_path: Path) -> None:
    config = write(tmp_path, f"http://127.0.0.1:{free_port()}", "/")
    proc = await status("--config", str(config), "--timeout", "0.5")
    assert proc.returncode == EXIT_UNAVAILABLE
    line = one_line(proc)
    assert line.startswith("controllerd: etcd at http://127.0.0.1:") and "did not answer" in line
    assert line.endswith("(setting: etcd.endpoints)")
    assert proc.stdout == ""


async def test_status_logs_as_the_logging_table_says(tmp_path: Path) -> None:
    """[logging] level = debug shows the retries; the old ``status`` ignored [logging]."""
    config = write(
        tmp_path,
        f"http://127.0.0.1:{free_port()}",
        "/",
        '[logging]\nlevel = "debug"\nformat = "json"\n',
    )
    proc = await status("--config", str(config), "--timeout", "0.5")
    assert proc.returncode == EXIT_UNAVAILABLE
    *logged, last = proc.stderr.splitlines()
    events = [json.loads(line) for line in logged]
    assert "store.retry" in {e["event"] for e in events}
    assert all(e["level"] == "debug" for e in events)
    assert last.startswith("controllerd: etcd at")


async def test_refused_credentials_are_status_3_naming_the_password_file(
    tmp_path: Path,
) -> None:
    server = EtcdServer(tmp_path / "data")
    await anyio.to_thread.run_sync(server.start)
    try:
        async with Etcd3Client([server.endpoint.removeprefix("http://")]) as admin:
            assert admin.auth is not None
            await admin.auth.user_add("root", "rootpw")
            await admin.auth.role_add("root")
            await admin.auth.user_grant_role("root", "root")
            await admin.auth.auth_enable()
        password = tmp_path / "etcd-password"
        password.write_text("wrong\n", encoding="utf-8")
        config = write(
            tmp_path,
            server.endpoint,
            "/",
            etcd_extra=f'username = "root"\npassword_file = "{password}"\n',
        )
        proc = await status("--config", str(config), "--timeout", "1")
        assert proc.returncode == EXIT_UNAVAILABLE
        line = one_line(proc)
        assert "refused" in line and "authentication failed" in line
        assert line.endswith("(setting: etcd.password_file)")
        password.write_text("rootpw\n", encoding="utf-8")
        proc = await status("--config", str(config), "--timeout", "1")
        assert proc.returncode == 1
        *logged, last = proc.stderr.splitlines()  # [logging] is info: the login is logged
        assert [json.loads(line)["event"] for line in logged] == ["store.authenticated"]
        assert "has no leader" in last
    finally:
        server.close()


def sharded(cfg: config_mod.Config, shards: int) -> config_mod.Config:
    """``cfg`` as ``[election] mode = "sharded"`` would give it (before config.py has it)."""
    election = types.SimpleNamespace(mode="sharded", shards=shards, lease_ttl_seconds=10)
    view = types.SimpleNamespace(
        etcd=cfg.etcd, election=election, cluster=cfg.cluster, controller_root=cfg.controller_root
    )
    return cast(config_mod.Config, view)


async def test_sharded_status_reads_members_and_shard_owners(
    etcd_server: EtcdServer, etcd_prefix: str, store: Store
) -> None:
    cfg = sharded(
        config_mod.load(
            f'[etcd]\nendpoints = ["{etcd_server.endpoint}"]\n'
            f'controller_prefix = "{etcd_prefix}c"\n'
        ),
        4,
    )
    root = cfg.controller_root
    for name in ("a", "b"):
        await store.put(f"{root}/members/{name}", json.dumps({"host": f"h-{name}"}).encode())
    for shard, owner in ((0, "a"), (1, "b"), (2, "a")):
        await store.put(
            f"{root}/shards/{shard_name(shard)}", json.dumps({"replica": owner}).encode()
        )
    await store.put(f"{root}/shards/junk", b"x")
    state = await status_mod.read_status(cfg, within=2)
    assert state["mode"] == "sharded" and state["shards"] == 4
    assert [(m["member"], m["shards_owned"], m["host"]) for m in state["members"]] == [
        ("a", 2, "h-a"),
        ("b", 1, "h-b"),
    ]
    assert state["owned_shards"] == 3 and state["unowned_shards"] == [3]
    assert set(state["shard_owners"]) == {"0000", "0001", "0002"}
    why = status_mod.problem(state, cfg)
    assert why is not None and "1 of 4 shards have no owner (first: 0003)" in why
    await store.put(f"{root}/shards/0003", json.dumps({"replica": "b"}).encode())
    state = await status_mod.read_status(cfg, within=2)
    assert status_mod.problem(state, cfg) is None
    table = status_mod.render_table(state).splitlines()
    assert table[2] == "shards   4 of 4 owned"
    assert table[-3:] == ["MEMBER  SHARDS  HOST  PID", "a       2       h-a", "b       2       h-b"]


def test_sharded_view_ignores_foreign_keys_and_reports_no_members() -> None:
    def kv(key: str, value: bytes, rev: int = 5) -> KeyValue:
        return KeyValue(key, value, rev, rev, 1, 0)

    view = status_mod.sharded_view(
        "/c/x", 2, [], [kv("/c/x/shards/0001", b"not json"), kv("/c/x/shards/0007", b"{}")]
    )
    assert view["shard_owners"] == {"0001": {"owner": "not json", "fencing_token": 5}}
    assert view["unowned_shards"] == [0]
    cfg = config_mod.Config()
    why = status_mod.problem({"mode": "sharded", **view}, cfg)
    assert why is not None and "no live members" in why


async def test_read_status_raises_an_operator_error_not_a_store_error() -> None:
    cfg = config_mod.load(f'[etcd]\nendpoints = ["http://127.0.0.1:{free_port()}"]\n')
    with pytest.raises(OperatorError) as caught:
        await status_mod.read_status(cfg, within=0.3)
    assert caught.value.exit_code == EXIT_UNAVAILABLE
    assert caught.value.setting == "etcd.endpoints"
