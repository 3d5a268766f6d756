"""``controllerd decide`` and ``check-config``: the scripted contract and its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controllerd.cli import main
from controllerd.core.layout import initial_layout
from controllerd.core.model import layout_to_json

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOW = 1_760_000_400_000


def write(tmp_path: Path, name: str, obj: Any) -> str:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 and out.startswith("{") else out), err


def rec(msg_in: float, changed: int = NOW - 3 * 3_600_000, **extra: Any) -> dict[str, Any]:
    return {
        "msgRateIn": msg_in,
        "bytesRateIn": 0,
        "msgRateOut": 0,
        "byteRateOut": 0,
        "changedAtMs": changed,
        **extra,
    }


def test_readme_example_splits_the_hot_segment_four_ways(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys,
        "decide",
        "--layout",
        str(EXAMPLES / "layout.json"),
        "--load",
        str(EXAMPLES / "load.json"),
        "--consumers",
        str(EXAMPLES / "consumers.json"),
        "--now-ms",
        str(NOW),
    )
    assert code == 0
    assert out["action"] == "split" and out["segments"] == [2]
    assert out["boundaries"] == [0xA000, 0xC000, 0xE000] and out["reason"] == "msgRateIn"
    assert set(out) >= {"action", "segments", "boundaries", "reason"}


def test_merge_and_none_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lay = write(tmp_path, "l.json", layout_to_json(initial_layout(2)))
    cold = write(tmp_path, "load.json", {"0": rec(5), "1": rec(6)})
    code, out, _ = run(capsys, "decide", "--layout", lay, "--load", cold, "--now-ms", str(NOW))
    assert (code, out["action"], out["segments"], out["boundaries"], out["reason"]) == (
        0,
        "merge",
        [0, 1],
        [],
        "cold",
    )
    code, out, _ = run(
        capsys,
        "decide",
        "--layout",
        lay,
        "--load",
        cold,
        "--now-ms",
        str(NOW),
        "--last-merge-ms",
        str(NOW - 1000),
    )
    assert (out["action"], out["segments"], out["reason"]) == ("none", [], "merge-cooldown")


def test_queue_subscriptions_do_not_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lay = write(tmp_path, "l.json", layout_to_json(initial_layout(1)))
    load = write(tmp_path, "load.json", {})
    queue = write(tmp_path, "c.json", {"q": {"type": "QUEUE", "consumers": 9}})
    stream = write(tmp_path, "s.json", {"q": {"type": "QUEUE", "consumers": 9}, "s": 3})
    _, out, _ = run(
        capsys, "decide", "--layout", lay, "--load", load, "--consumers", queue, "--now-ms", "0"
    )
    assert out["action"] == "none"
    _, out, _ = run(
        capsys, "decide", "--layout", lay, "--load", load, "--consumers", stream, "--now-ms", "0"
    )
    assert out["action"] == "split" and out["reason"] == "consumer-count"
    assert len(out["boundaries"]) == 2


def test_config_and_topic_override_apply(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = layout_to_json(initial_layout(1))
    lay = write(tmp_path, "l.json", raw)
    load = write(tmp_path, "load.json", {"0": rec(5_000)})
    conf = write(tmp_path, "c.toml", "[policy.split_thresholds]\nmsg_rate_in = 2000\n")
    _, out, _ = run(
        capsys, "decide", "--layout", lay, "--load", load, "--config", conf, "--now-ms", str(NOW)
    )
    assert out["action"] == "split" and len(out["boundaries"]) == 2
    raw["autoScalePolicy"] = {"enabled": False}
    lay = write(tmp_path, "l2.json", raw)
    _, out, _ = run(
        capsys, "decide", "--layout", lay, "--load", load, "--config", conf, "--now-ms", str(NOW)
    )
    assert (out["action"], out["reason"]) == ("none", "disabled")


@pytest.mark.parametrize(
    ("which", "content", "message"),
    [
        ("layout", "{not json", "not JSON"),
        ("layout", {"segments": {"0": {"segmentId": 0}}}, "hashRange"),
        ("layout", {"segments": {}}, "tile"),
        ("load", {"0": {"msgRateIn": "hot"}}, "msgRateIn"),
        ("load", {"zero": rec(1)}, "segment id"),
        ("load", [1, 2], "object"),
        ("consumers", {"s": -1}, "consumer count"),
        ("consumers", {"s": "many"}, "consumer count"),
    ],
)
def test_malformed_input_exits_2_with_a_clear_message(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    which: str,
    content: Any,
    message: str,
) -> None:
    files = {
        "layout": layout_to_json(initial_layout(1)),
        "load": {},
        "consumers": {},
    }
    files[which] = content
    paths = {k: write(tmp_path, f"{k}.json", v) for k, v in files.items()}
    code, _, err = run(
        capsys,
        "decide",
        "--layout",
        paths["layout"],
        "--load",
        paths["load"],
        "--consumers",
        paths["consumers"],
        "--now-ms",
        "0",
    )
    assert code == 2
    assert message in err and paths[which] in err


def test_missing_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "decide", "--layout", "/nonexistent.json", "--load", "x", "--now-ms", "0"
    )
    assert code == 2 and "/nonexistent.json" in err


def test_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo_config = Path(__file__).resolve().parent.parent / "config" / "controllerd.toml"
    code, out, _ = run(capsys, "check-config", str(repo_config))
    assert code == 0 and "ok" in out
    bad = write(
        tmp_path,
        "bad.toml",
        "[policy]\nmin_segments = 0\nmax_segmnts = 3\n[broker]\nprofile = 'kafka'\n",
    )
    code, _, err = run(capsys, "check-config", bad)
    assert code == 1
    for field in ("policy.min_segments", "policy.max_segmnts", "broker.profile"):
        assert field in err


def test_console_entry_point_runs_as_a_process() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "controllerd.cli",
            "decide",
            "--layout",
            str(EXAMPLES / "layout.json"),
            "--load",
            str(EXAMPLES / "load.json"),
            "--now-ms",
            "0",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["action"] == "split"
