"""``refbroker`` on an etcd that wants credentials or TLS, as an operator runs it.

The broker takes ``[etcd]`` of ``--config`` (user, password file, CA bundle, client
certificate) as ``controllerd run`` does. It used to open etcd with none of them:
on an etcd with authentication every admin call answered 503 ("user name is
empty") for as long as it ran, and an https etcd with a private CA could not be
reached at all. A refusal at start is now status 3 and one line naming the setting;
an etcd that is down at start is still waited for.

Every broker here is a subprocess on the session's tansu; etcds are this module's own.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from etcd3aio import Etcd3Client, PermissionType

from controllerd.errors import EXIT_UNAVAILABLE, EXIT_USAGE
from tests.support.etcd import EtcdServer, make_pki
from tests.test_refbroker_cli import LISTEN_TIMEOUT, REFBROKER, Output, run, serving

#: Everything this module's brokers keep in etcd; the ``broker`` user may use all of it.
ROOT = "/rbauth"
METADATA_PREFIX = f"{ROOT}/pulsar"
CONTROLLER_PREFIX = f"{ROOT}/controllerd"
#: user -> (password, the key prefix its role may read and write)
USERS = {
    "broker": ("broker-pw", f"{ROOT}/"),
    # may touch the metadata, not the controller's keys: not its fencing key
    "narrow": ("narrow-pw", f"{METADATA_PREFIX}/"),
}
#: Seconds a broker that etcd refuses gets to exit (it takes about one).
EXIT_TIMEOUT = 20.0


def _range_end(prefix: str) -> bytes:
    return prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1])


async def _enable_auth(endpoint: str) -> None:
    async with Etcd3Client([endpoint.removeprefix("http://")]) as admin:
        assert admin.auth is not None
        await admin.auth.user_add("root", "root-pw")
        await admin.auth.role_add("root")
        await admin.auth.user_grant_role("root", "root")
        for user, (password, prefix) in USERS.items():
            await admin.auth.user_add(user, password)
            await admin.auth.role_add(user)
            await admin.auth.role_grant_permission(
                user, prefix, _range_end(prefix), perm_type=PermissionType.READWRITE
            )
            await admin.auth.user_grant_role(user, user)
        await admin.auth.auth_enable()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """An etcd with authentication on and the users of :data:`USERS`."""
    server = EtcdServer(tmp_path_factory.mktemp("auth-etcd") / "data")
    server.start()
    try:
        anyio.run(_enable_auth, server.endpoint)
        yield server
    finally:
        server.close()


def write_config(tmp_path: Path, endpoint: str, etcd_extra: str = "") -> Path:
    config = tmp_path / "controllerd.toml"
    config.write_text(
        f'[etcd]\nendpoints = ["{endpoint}"]\ncontroller_prefix = "{CONTROLLER_PREFIX}"\n'
        + etcd_extra,
        encoding="utf-8",
    )
    return config


def credentials(tmp_path: Path, user: str, password: str) -> str:
    """``[etcd]`` lines naming ``user`` and a password file holding ``password``."""
    secret = tmp_path / f"{user}.password"
    secret.write_text(f"{password}\n", encoding="utf-8")
    return f'username = "{user}"\npassword_file = "{secret}"\n'


def broker_argv(kafka: str, config: Path, *extra: str) -> list[str]:
    return [
        *REFBROKER,
        "--kafka",
        kafka,
        "--listen",
        "127.0.0.1:0",
        "--metadata-prefix",
        METADATA_PREFIX,
        "--connect-timeout",
        "10",
        "--config",
        str(config),
        *extra,
    ]


def create_and_list(port: int) -> None:
    """One admin call that writes etcd and one that reads it, both answered."""
    topic = f"t{uuid.uuid4().hex[:12]}"
    base = f"http://127.0.0.1:{port}/admin/v2/scalable/acme/ns"
    with httpx.Client(timeout=15) as http:
        created = http.put(f"{base}/{topic}")
        assert created.status_code == 204, created.text
        listed = http.get(base)
        assert listed.status_code == 200, listed.text
        assert f"topic://acme/ns/{topic}" in listed.json()


def test_the_config_credentials_let_the_broker_serve(
    auth_etcd: EtcdServer, kafka_broker: str, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path, auth_etcd.endpoint, credentials(tmp_path, "broker", "broker-pw")
    )
    argv = broker_argv(kafka_broker, config, "--etcd", auth_etcd.endpoint)
    with serving(argv) as broker:
        create_and_list(broker.listening["port"])
        assert '"store.authenticated"' in broker.stderr.text


@pytest.mark.parametrize(
    ("user", "password", "refused", "why", "setting"),
    [
        (
            "broker",
            "wrong",
            "refused us",
            "authentication failed",
            "etcd.username/etcd.password_file",
        ),
        (
            None,
            None,
            f"refused us a read of {METADATA_PREFIX}/topics/",
            "user name is empty",
            "etcd.username",
        ),
        (
            "narrow",
            "narrow-pw",
            f"refused us a read of {CONTROLLER_PREFIX}/default/leader",
            "permission denied",
            "etcd.username",
        ),
    ],
    ids=["wrong-password", "no-user", "no-permission-on-the-fencing-key"],
)
def test_a_refusal_at_start_is_status_3_naming_the_setting(
    auth_etcd: EtcdServer,
    kafka_broker: str,
    tmp_path: Path,
    user: str | None,
    password: str | None,
    refused: str,
    why: str,
    setting: str,
) -> None:
    """It used to serve 503 to every call, log reporter.failed every second, never exit."""
    extra = credentials(tmp_path, user, password) if user and password else ""
    config = write_config(tmp_path, auth_etcd.endpoint, extra)
    try:
        done = run(broker_argv(kafka_broker, config), timeout=EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the broker etcd refused ({why}) still ran after {EXIT_TIMEOUT}s")
    assert done.returncode == EXIT_UNAVAILABLE, done.stderr
    logged = [json.loads(line)["event"] for line in done.stderr.splitlines()[:-1]]
    assert set(logged) <= {"store.authenticated"}, done.stderr  # nothing but the login
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"controllerd: etcd at {auth_etcd.endpoint} {refused}: "), last
    assert why in last and last.endswith(f"(setting: {setting})"), last


def test_an_unreadable_password_file_is_one_line(tmp_path: Path) -> None:
    """Checked before anything starts, as ``controllerd run`` checks it."""
    missing = tmp_path / "nope.password"
    config = write_config(
        tmp_path,
        "http://127.0.0.1:2379",
        f'username = "broker"\npassword_file = "{missing}"\n',
    )
    done = run(broker_argv("127.0.0.1:9", config), timeout=EXIT_TIMEOUT)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert done.stderr.splitlines() == [
        f"controllerd: {config}: etcd.password_file: cannot read {missing}: "
        "No such file or directory"
    ]


def test_an_https_etcd_with_a_private_ca_is_reached_on_the_config_endpoints(
    tmp_path: Path, kafka_broker: str
) -> None:
    """No --etcd: the endpoints, the CA and the client certificate all come from [etcd]."""
    pki = make_pki(tmp_path / "pki")
    server = EtcdServer(tmp_path / "etcd", pki)
    server.start()
    try:
        tls = (
            f'ca_file = "{pki.ca}"\n'
            f'cert_file = "{pki.client_cert}"\nkey_file = "{pki.client_key}"\n'
        )
        config = write_config(tmp_path, server.endpoint, tls)
        with serving(broker_argv(kafka_broker, config)) as broker:
            assert broker.listening["etcd"] == server.endpoint
            create_and_list(broker.listening["port"])
    finally:
        server.close()


def test_an_etcd_down_at_start_is_waited_for(tmp_path: Path, kafka_broker: str) -> None:
    """An outage is not a refusal: the broker retries (one line per retry) until etcd answers."""
    server = EtcdServer(tmp_path / "etcd")  # not started yet
    config = write_config(tmp_path, server.endpoint)
    proc = subprocess.Popen(
        broker_argv(kafka_broker, config), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    stderr = Output(proc.stderr.fileno())
    try:
        retry = json.loads(stderr.until(r'^\{.*"refbroker\.etcd\.retry".*\}$', 15).group(0))
        assert retry["etcd"] == server.endpoint and retry["attempt"] == 1
        assert proc.poll() is None
        server.start()
        listening = stderr.until(r'^\{.*"refbroker\.listening".*\}$', LISTEN_TIMEOUT)
        create_and_list(json.loads(listening.group(0))["port"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        server.close()
