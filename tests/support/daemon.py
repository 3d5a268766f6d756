"""``controllerd run`` replicas as real subprocesses, for end-to-end and failover tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx

from tests.support.kafka import free_port

#: ``write_config(metadata_prefix=DEFAULT_PREFIX)`` writes no metadata_prefix at all.
DEFAULT_PREFIX = "<default>"


def write_config(
    path: Path,
    *,
    etcd: str,
    prefix: str,
    broker_url: str,
    port: int,
    extra: str = "",
    profile: str = "reference",
    lease_ttl: int = 2,
    metadata_prefix: str | None = None,
    token_file: Path | None = None,
    shards: int | None = None,
) -> Path:
    metadata = f"{prefix}pulsar" if metadata_prefix is None else metadata_prefix
    # DEFAULT_PREFIX: leave the setting out, as an operator's config would
    prefix_line = "" if metadata == DEFAULT_PREFIX else f'metadata_prefix = "{metadata}"'
    token = f'token_file = "{token_file}"' if token_file is not None else ""
    path.write_text(
        f"""
[etcd]
endpoints = ["{etcd}"]
{prefix_line}
controller_prefix = "{prefix}controllerd"
[election]
lease_ttl_seconds = {lease_ttl}
{f'mode = "sharded"{chr(10)}shards = {shards}' if shards else ""}
[broker]
admin_url = "{broker_url}"
profile = "{profile}"
timeout_seconds = 2
max_retries = 1
{token}
[http]
listen = "127.0.0.1:{port}"
[logging]
level = "info"
format = "json"
{extra}
""",
        encoding="utf-8",
    )
    return path


@dataclass
class Replica:
    """One ``controllerd run`` process and its ops endpoint."""

    name: str
    config: Path
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, **self.env}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "controllerd.cli", "run", "--config", str(self.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    async def get(self, path: str) -> httpx.Response | None:
        try:
            async with httpx.AsyncClient(timeout=1.0) as client:
                return await client.get(self.url + path)
        except httpx.HTTPError:
            return None

    async def status(self) -> dict[str, Any] | None:
        response = await self.get("/status")
        if response is None or response.status_code != 200:
            return None
        body: dict[str, Any] = response.json()
        return body

    async def is_leader(self) -> bool:
        status = await self.status()
        return bool(status and status.get("leader"))

    async def ready(self) -> bool:
        response = await self.get("/readyz")
        return response is not None and response.status_code == 200

    async def metric(self, name: str, **labels: str) -> float | None:
        """One sample from /metrics (text format), or None when absent."""
        response = await self.get("/metrics")
        if response is None:
            return None
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in response.text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            metric, _, rest = key.partition("{")
            if metric != name:
                continue
            got = ",".join(sorted(p for p in rest.rstrip("}").split(",") if p))
            if got == wanted:
                return float(value)
        return None

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
        return events

    async def stop(self) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                await anyio.to_thread.run_sync(self.wait, 15.0)
            except subprocess.TimeoutExpired:
                assert self.proc is not None
                self.proc.kill()
                self.proc.wait()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], within: float = 20.0, step: float = 0.01
) -> float:
    """Wait until ``await predicate()`` holds (an outcome in another process); seconds taken."""
    start = time.monotonic()
    with anyio.fail_after(within):
        while not await predicate():  # noqa: ASYNC110 - another process; no event to await
            await anyio.sleep(step)
    return time.monotonic() - start


@contextlib.asynccontextmanager
async def replicas(tmp: Path, count: int, **config: Any) -> AsyncIterator[list[Replica]]:
    """``count`` running replicas sharing one config (each with its own ops port)."""
    tmp.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any process
    started: list[Replica] = []
    try:
        for i in range(count):
            port = free_port()
            path = write_config(tmp / f"replica-{i}.toml", port=port, **config)
            replica = Replica(f"r{i}", path, port, tmp / f"replica-{i}.log")
            replica.start()
            started.append(replica)
        for replica in started:
            await wait_until(replica.ready)
        yield started
    finally:
        with anyio.CancelScope(shield=True):
            for replica in started:
                await replica.stop()
