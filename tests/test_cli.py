"""The ``controllerd`` command line: ``decide``'s contract, ``check-config``, and the
one-line errors and exit statuses every command shares (run as a real process)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from controllerd.cli import build_parser, main
from controllerd.core.layout import initial_layout
from controllerd.core.model import layout_to_json
from tests.support.etcd import Pki, make_pki

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
        # a typo counted as STREAM: a consumer-count split that QUEUE would not make
        ("consumers", {"s": {"type": "QUEUEE", "consumers": 12}}, "'QUEUEE' is not one of"),
        ("consumers", {"s": {"type": 7, "consumers": 12}}, "type 7 is not one of"),
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


# --- the console script as a process: one line, one documented exit status -----------

ROOT = Path(__file__).resolve().parent.parent


def cli(
    *argv: str, env: dict[str, str] | None = None, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m controllerd.cli ARGV`` from this tree, in a clean CONTROLLERD_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLLERD_")}
    base["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "controllerd.cli", *argv],
        env={**base, **(env or {})},
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return subprocess.CompletedProcess(
        proc.args,
        proc.returncode,
        proc.stdout.decode("utf-8", "replace"),
        proc.stderr.decode("utf-8", "replace"),
    )


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The only line on stderr (asserts there is exactly one, so never a traceback)."""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def decide_files(tmp_path: Path, **override: bytes) -> dict[str, str]:
    files = {
        "layout": json.dumps(layout_to_json(initial_layout(1))).encode(),
        "load": b"{}",
        "consumers": b"{}",
        **override,
    }
    paths = {}
    for name, content in files.items():
        (tmp_path / f"{name}.json").write_bytes(content)
        paths[name] = str(tmp_path / f"{name}.json")
    return paths


def load_record(rate: str) -> bytes:
    return (
        '{"0": {"msgRateIn": ' + rate + ', "bytesRateIn": 0, "msgRateOut": 0, '
        '"byteRateOut": 0, "changedAtMs": 0}}'
    ).encode()


@pytest.mark.parametrize(
    ("which", "content", "names"),
    [
        ("layout", b"\xff\xfe{}", ["not UTF-8"]),
        ("load", b'{"0": "caf\xe9"}', ["not UTF-8"]),
        ("layout", b"[" * 100_000, ["nested too deeply"]),
        ("consumers", b'{"s": ' + b"[" * 100_000, ["nested too deeply"]),
        ("load", load_record("9" * 400), ["0.msgRateIn", "out of range"]),
        ("load", load_record("1e999"), ["msgRateIn"]),
        ("layout", b'{"epoch": 1e999, "segments": {}}', ["epoch", "out of range"]),
        ("load", load_record("1" + "0" * 5000), ["not JSON"]),
    ],
)
def test_decide_refuses_hostile_input_in_one_line_with_status_2(
    tmp_path: Path, which: str, content: bytes, names: list[str]
) -> None:
    paths = decide_files(tmp_path, **{which: content})
    proc = cli(
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
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert line.startswith("controllerd: ") and paths[which] in line
    for name in names:
        assert name in line


def test_decide_reads_stdin_for_dash(tmp_path: Path) -> None:
    proc = cli(
        "decide",
        "--layout",
        "-",
        "--load",
        str(EXAMPLES / "load.json"),
        "--now-ms",
        "0",
        stdin=(EXAMPLES / "layout.json").read_bytes(),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["action"] == "split"


#: (setting, TOML that sets it to a missing file, plus whatever it needs to be valid)
MISSING_FILES = [
    ("etcd.password_file", '[etcd]\nusername = "u"\npassword_file = "{missing}"\n'),
    ("broker.token_file", '[broker]\ntoken_file = "{missing}"\n'),
    ("etcd.ca_file", '[etcd]\nca_file = "{missing}"\n'),
    ("etcd.cert_file", '[etcd]\ncert_file = "{missing}"\nkey_file = "{key}"\n'),
    ("etcd.key_file", '[etcd]\ncert_file = "{cert}"\nkey_file = "{missing}"\n'),
    ("broker.ca_file", '[broker]\nca_file = "{missing}"\n'),
    ("broker.cert_file", '[broker]\ncert_file = "{missing}"\nkey_file = "{key}"\n'),
    ("broker.key_file", '[broker]\ncert_file = "{cert}"\nkey_file = "{missing}"\n'),
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def config_naming(tmp_path: Path, template: str, pki: Pki) -> tuple[Path, str]:
    missing = str(tmp_path / "credentials" / "absent")
    text = template.format(missing=missing, cert=pki.client_cert, key=pki.client_key)
    path = tmp_path / "controllerd.toml"
    path.write_text(text + '[http]\nlisten = "127.0.0.1:0"\n', encoding="utf-8")
    return path, missing


@pytest.mark.parametrize(("setting", "template"), MISSING_FILES)
def test_run_refuses_a_missing_file_before_starting_anything(
    tmp_path: Path, pki: Pki, setting: str, template: str
) -> None:
    path, missing = config_naming(tmp_path, template, pki)
    proc = cli("run", "--config", str(path))
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc)
    assert f"{setting}: cannot read {missing}" in line and line.count(str(path)) == 1
    assert proc.stdout == ""


@pytest.mark.parametrize(("setting", "template"), MISSING_FILES)
def test_check_config_opens_every_file_the_config_names(
    tmp_path: Path, pki: Pki, setting: str, template: str
) -> None:
    path, missing = config_naming(tmp_path, template, pki)
    proc = cli("check-config", str(path))
    assert proc.returncode == 1, proc.stderr
    assert f"{setting}: cannot read {missing}" in one_line(proc)


def test_an_encrypted_client_key_is_refused_without_a_passphrase_prompt(
    tmp_path: Path, pki: Pki
) -> None:
    """OpenSSL prompted for the passphrase on the terminal and, without one, raised an
    OSError: an internal error (70) at start, a crash on SIGHUP. A daemon has no
    terminal to type it on: an encrypted key is refused, naming it."""
    encrypted = tmp_path / "client-encrypted.key"
    out = subprocess.run(
        ["openssl", "pkey", "-in", str(pki.client_key), "-aes256", "-passout", "pass:secret"],
        check=True,
        capture_output=True,
    ).stdout
    encrypted.write_bytes(out)
    path = tmp_path / "controllerd.toml"
    path.write_text(
        f'[broker]\ncert_file = "{pki.client_cert}"\nkey_file = "{encrypted}"\n',
        encoding="utf-8",
    )
    proc = cli("check-config", str(path))
    assert proc.returncode == 1, proc.stderr
    assert "unencrypted private key" in one_line(proc) and "pass phrase" not in proc.stderr


def test_toml_python_cannot_hold_is_invalid_toml_not_an_internal_error(tmp_path: Path) -> None:
    """An integer of more than 4,300 digits and nesting thousands deep raised ValueError
    and RecursionError out of tomllib, past the config's parsing boundary (exit 70)."""
    for name, text in (
        ("huge", "[policy]\nmax_segments = " + "9" * 5000 + "\n"),
        ("deep", "x = " + "[" * 5000 + "]" * 5000 + "\n"),
    ):
        path = tmp_path / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        proc = cli("check-config", str(path))
        assert proc.returncode == 1, proc.stderr
        assert "invalid TOML" in one_line(proc)


def test_check_config_loads_certificates_and_refuses_empty_secrets(
    tmp_path: Path, pki: Pki
) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n", encoding="utf-8")
    good = tmp_path / "good.toml"
    good.write_text(
        f'[etcd]\nca_file = "{pki.ca}"\ncert_file = "{pki.client_cert}"\n'
        f'key_file = "{pki.client_key}"\n',
        encoding="utf-8",
    )
    proc = cli("check-config", str(good))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{good}: ok\n", "")
    bad = tmp_path / "bad.toml"
    bad.write_text(
        f'[etcd]\nca_file = "{pki.client_key}"\ncert_file = "{pki.client_cert}"\n'
        f'key_file = "{pki.server_key}"\n[broker]\ntoken_file = "{empty}"\n',
        encoding="utf-8",
    )
    proc = cli("check-config", str(bad))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr
    assert any("etcd.ca_file:" in line and "not a PEM CA bundle" in line for line in lines)
    assert any("etcd.cert_file:" in line and "private key" in line for line in lines)
    assert any(f"broker.token_file: {empty} is empty" in line for line in lines)


def test_check_config_honours_the_environment_and_stdin(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[policy]\nmax_segments = 32\n", encoding="utf-8")
    proc = cli("check-config", env={"CONTROLLERD_CONFIG": str(config)})
    assert (proc.returncode, proc.stdout) == (0, f"{config}: ok\n"), proc.stderr
    proc = cli("check-config", "-", stdin=b"[policy]\nmin_segments = 0\n")
    assert proc.returncode == 1
    assert one_line(proc).startswith("<stdin>: policy.min_segments: must be >= 1")
    proc = cli("check-config", "-", stdin=b"[policy]\n", env={"CONTROLLERD_POLICY__BOGUS": "1"})
    assert proc.returncode == 1 and "CONTROLLERD_POLICY__BOGUS" in one_line(proc)
    proc = cli("check-config")
    assert proc.returncode == 2 and "CONTROLLERD_CONFIG" in one_line(proc)


@pytest.mark.parametrize(
    ("content", "expect"),
    [(None, "No such file or directory"), (b"\xff", "not UTF-8"), (b"[policy\n", "invalid TOML")],
)
def test_check_config_names_the_file_once(
    tmp_path: Path, content: bytes | None, expect: str
) -> None:
    path = tmp_path / "controllerd.toml"
    if content is not None:
        path.write_bytes(content)
    proc = cli("check-config", str(path))
    assert proc.returncode == 1
    line = one_line(proc)
    assert line.count(str(path)) == 1 and line.startswith(f"{path}: ") and expect in line


HUGE = 10**400
REFUSED_BY_CHECK_AND_RUN = [
    (f"[policy.split_thresholds]\nmsg_rate_in = {HUGE}\n", "policy.split_thresholds.msg_rate_in"),
    (f"[election]\nlease_ttl_seconds = {2**64}\n", "election.lease_ttl_seconds: an integer"),
    ("[election]\nlease_ttl_seconds = 1000000000000\n", "lease_ttl_seconds: must be at most"),
    ('[etcd]\nendpoints = ["http://127.0.0.1:99999"]\n', "etcd.endpoints[0]: Port out of range"),
    ('[etcd]\nendpoints = ["http://[::1"]\n', "etcd.endpoints[0]: Invalid IPv6 URL"),
    ('[etcd]\nendpoints = ["http://127.0.0.1"]\n', "etcd.endpoints: etcd endpoint must be"),
    ('[broker]\nadmin_url = "http://x:abc"\n', "broker.admin_url: Port could not be cast"),
    ('[broker]\ntoken_file = "{token}"\n', "broker.token_file: {token} must hold one line"),
    ("# nothing but a comment\n", "config file is empty"),
]


@pytest.mark.parametrize(("text", "expect"), REFUSED_BY_CHECK_AND_RUN)
def test_what_check_config_passes_run_starts_with(tmp_path: Path, text: str, expect: str) -> None:
    """Each of these passed check-config (or crashed it) and ended `run` as an internal error."""
    token = tmp_path / "token"
    token.write_text("tok\nen\n", encoding="utf-8")
    config = tmp_path / "c.toml"
    config.write_text(text.replace("{token}", str(token)), encoding="utf-8")
    check = cli("check-config", str(config))
    assert check.returncode == 1 and expect.replace("{token}", str(token)) in check.stderr
    assert "Traceback" not in check.stderr and "internal error" not in check.stderr
    started = cli("run", "--config", str(config))
    assert started.returncode == 2, started.stderr
    assert expect.replace("{token}", str(token)) in started.stderr
    assert "internal error" not in started.stderr


def test_a_huge_integer_in_the_environment_is_refused_naming_the_variable(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[policy]\nmax_segments = 32\n", encoding="utf-8")
    proc = cli("check-config", str(config), env={"CONTROLLERD_ETCD__TIMEOUT_SECONDS": str(HUGE)})
    assert proc.returncode == 1 and "CONTROLLERD_ETCD__TIMEOUT_SECONDS" in one_line(proc)


def test_run_refuses_a_config_on_standard_input(tmp_path: Path) -> None:
    proc = cli("run", "--config", "-", stdin=b"[policy]\nmax_segments = 32\n")
    assert proc.returncode == 2 and "not standard input" in one_line(proc)


def test_run_refuses_a_config_that_is_a_pipe(tmp_path: Path) -> None:
    """A FIFO is read once: SIGHUP would block on it (the daemon refuses it there too)."""
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    proc = cli("run", "--config", str(fifo))
    assert proc.returncode == 2 and "regular config file" in one_line(proc)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_secret_that_is_not_a_regular_file_is_refused_without_reading_it(
    tmp_path: Path, special: str
) -> None:
    """``/dev/zero`` never ends and a FIFO blocks until a writer comes: neither is read."""
    if special == "fifo":
        special = str(tmp_path / "token")
        os.mkfifo(special)
    config = tmp_path / "c.toml"
    config.write_text(f'[broker]\ntoken_file = "{special}"\n', encoding="utf-8")
    proc = cli("check-config", str(config))
    line = one_line(proc)
    assert proc.returncode == 1 and "broker.token_file" in line and "not a regular file" in line


@pytest.mark.parametrize(
    ("toml", "setting"),
    [
        ('[cluster]\nname = "prod-\u00e9"\n', "cluster.name"),
        ('[etcd]\ncontroller_prefix = "/contr\u00f4le"\n', "etcd.controller_prefix"),
    ],
)
def test_a_name_that_cannot_go_in_an_http_header_is_refused(
    tmp_path: Path, toml: str, setting: str
) -> None:
    """The leader key goes in the X-Fencing-Key header of every broker call: httpx refused
    a non-ASCII one when it built each request, after check-config had said ok."""
    config = tmp_path / "c.toml"
    config.write_text(toml, encoding="utf-8")
    proc = cli("check-config", str(config))
    assert proc.returncode == 1 and setting in one_line(proc) and "ASCII" in one_line(proc)


def test_a_bearer_token_that_is_not_ascii_is_refused(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\u00f6ken\n", encoding="utf-8")
    config = tmp_path / "c.toml"
    config.write_text(f'[broker]\ntoken_file = "{token}"\n', encoding="utf-8")
    proc = cli("check-config", str(config))
    line = one_line(proc)
    assert proc.returncode == 1 and "broker.token_file" in line and "ASCII" in line


BUG = (
    "import sys, controllerd.cli as cli\n"
    "def broken(args):\n"
    "    raise {exc}\n"
    "cli.cmd_demo = broken\n"
    "sys.exit(cli.main(['demo']))\n"
)


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLLERD_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_bug_is_one_line_and_status_70_with_the_traceback_on_request() -> None:
    proc = python(BUG.format(exc="KeyError('segments')"))
    assert proc.returncode == 70
    line = one_line(proc)
    assert line.startswith("controllerd: internal error: KeyError: 'segments'")
    assert "CONTROLLERD_DEBUG=1" in line
    proc = python(BUG.format(exc="KeyError('segments')"), env={"CONTROLLERD_DEBUG": "1"})
    assert proc.returncode == 70
    assert proc.stderr.splitlines()[0] == line
    assert "Traceback (most recent call last)" in proc.stderr and ", in broken" in proc.stderr


def test_ctrl_c_exits_130_quietly() -> None:
    proc = python(BUG.format(exc="KeyboardInterrupt()"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "")


def test_an_operator_error_inside_a_task_group_is_still_one_line() -> None:
    exc = (
        "ExceptionGroup('tasks', [__import__('controllerd.errors').errors.OperatorError("
        "'cannot listen on 127.0.0.1:9464: address in use', exit_code=2, setting='http.listen')])"
    )
    proc = python(BUG.format(exc=exc))
    assert proc.returncode == 2
    assert one_line(proc) == (
        "controllerd: cannot listen on 127.0.0.1:9464: address in use (setting: http.listen)"
    )


def test_version_help_and_no_arguments() -> None:
    proc = cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"controllerd {metadata.version('controllerd')}"
    proc = cli()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: controllerd") and "exit statuses" in proc.stderr
    for code in (0, 1, 2, 3, 70, 130):
        assert re.search(rf"^\s+{code}\s+\S", proc.stderr, re.MULTILINE), code


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (group,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(group.choices)


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_has_help_and_every_command_examples(command: str) -> None:
    sub = subcommands()[command]
    for action in sub._actions:
        assert action.help and action.help != argparse.SUPPRESS, (command, action.dest)
    text = sub.format_help()
    assert "examples:\n  controllerd " + command in text
    assert "exit status: 0 success" in text
    proc = cli(command, "--help")
    assert proc.returncode == 0 and "examples:\n  controllerd " + command in proc.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "tcsh"])
def test_completion_scripts_know_every_command(shell: str) -> None:
    proc = cli("completion", shell)
    assert proc.returncode == 0, proc.stderr
    for command in subcommands():
        assert command in proc.stdout
    if shell != "tcsh":  # shtab completes only subcommands and positionals for tcsh
        assert "--last-split-ms" in proc.stdout
    if shell == "bash":
        assert re.search(r"decide___layout_COMPGEN=_shtab_compgen_files", proc.stdout)
        bash = shutil.which("bash")
        assert bash
        # Source it in a real bash and ask it to complete "controllerd sta".
        script = (
            proc.stdout
            + '\nCOMP_WORDS=(controllerd sta); COMP_CWORD=1; COMP_LINE="controllerd sta"'
            + '\nCOMP_POINT=${#COMP_LINE}; _shtab_controllerd; echo "${COMPREPLY[*]}"\n'
        )
        check = subprocess.run(
            [bash, "--norc", "-s"],
            input=script,
            text=True,
            capture_output=True,
            timeout=30,
            check=False,
        )
        assert (check.returncode, check.stdout.split()) == (0, ["status"]), check.stderr


def test_a_config_file_without_its_flag_gets_a_hint() -> None:
    proc = cli("run", "controllerd.toml")
    assert proc.returncode == 2
    assert "a config file goes after --config: --config controllerd.toml" in proc.stderr


def test_an_environment_value_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    """It decoded to surrogates, passed check-config and ended `run` as an internal error."""
    config = tmp_path / "c.toml"
    config.write_text("[policy]\nmax_segments = 32\n", encoding="utf-8")
    env = {"CONTROLLERD_CLUSTER__NAME": os.fsdecode(b"\xff")}
    proc = cli("check-config", str(config), env=env)
    assert proc.returncode == 1
    line = one_line(proc)
    assert "cluster.name: is not valid UTF-8 text (from CONTROLLERD_CLUSTER__NAME)" in line


def test_decide_reads_at_most_one_input_from_stdin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The second '-' read an empty stream and was blamed for not being JSON."""
    code, _, err = run(capsys, "decide", "--layout", "-", "--load", "-", "--now-ms", "0")
    assert code == 2
    assert err.strip() == (
        "controllerd: only one input can be read from stdin ('-'), got --layout and --load"
    )
