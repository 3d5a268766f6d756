"""The ``controllerd`` command line.

Each subcommand is a thin shell over the core or the daemon; heavy modules are
imported inside the command so that ``decide`` and ``check-config`` start fast
and need none of the daemon's dependencies.

:func:`main` is the one place that turns what escapes a command into an exit
status (:mod:`controllerd.errors`): an :class:`~controllerd.errors.OperatorError`
is one line ``controllerd: <cause> (setting: <name>)``; an invalid config is one
line per error, each naming its setting; Ctrl-C exits 130 quietly; anything else
is a bug, reported in one line with exit 70 (the traceback only with
``CONTROLLERD_DEBUG=1``). No command prints a traceback for an operator's mistake.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from controllerd import config as config_mod
from controllerd.adapters.secrets import config_file_errors
from controllerd.core import layout as layout_mod
from controllerd.core.model import (
    SUBSCRIPTION_TYPES,
    LoadSample,
    ModelError,
    decision_to_json,
    layout_from_json,
    load_sample_from_json,
)
from controllerd.core.policy import decide, resolve_policy
from controllerd.errors import (
    DEBUG_ENV,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOFTWARE,
    EXIT_STATUSES,
    EXIT_USAGE,
    OperatorError,
    internal_error_line,
)
from controllerd.files import is_special
from controllerd.pipeline.cli import add_commands as add_pipeline_commands
from controllerd.refbroker.options import add_arguments as add_refbroker_arguments

EXIT_BAD_INPUT: Final = EXIT_USAGE
"""Former name of :data:`~controllerd.errors.EXIT_USAGE`, kept for importers."""

PROG: Final = "controllerd"
STDIN: Final = "-"

#: Integers in input JSON must fit Java's long, as every integer field of Pulsar's
#: JSON does; a larger one (a 400-digit rate) is refused with its path.
_JAVA_LONG: Final = 2**63


class InputError(Exception):
    """Malformed user input; the message says which file and field."""


class ConfigInvalid(Exception):
    """An unusable config: ``lines`` are printed one per line, then exit ``exit_code``."""

    def __init__(self, lines: Sequence[str], exit_code: int) -> None:
        super().__init__("\n".join(lines))
        self.lines = list(lines)
        self.exit_code = exit_code


# --- input files ----------------------------------------------------------------------


def _display(path: str) -> str:
    return "<stdin>" if path == STDIN else path


def _read_text(path: str, what: str) -> str:
    """The UTF-8 text of ``path`` (``-`` = stdin); InputError naming the file otherwise."""
    try:
        if path == STDIN:
            return sys.stdin.buffer.read().decode("utf-8")
        return Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"{what} {_display(path)}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {_display(path)}: not UTF-8 text "
            f"(byte {exc.start} is {exc.object[exc.start]:#04x})"
        ) from None


def _read_json(path: str, what: str) -> Any:
    text = _read_text(path, what)
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InputError(f"{what} {_display(path)}: not JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise InputError(f"{what} {_display(path)}: not JSON: {exc}") from None
    bad = _out_of_range(obj)
    if bad is not None:
        field, value = bad
        raise InputError(
            f"{what} {_display(path)}: {field}: number out of range ({value})"
        ) from None
    return obj


def _out_of_range(obj: Any) -> tuple[str, str] | None:
    """The first integer past Java's long or non-finite float, as (json path, value)."""
    stack: list[tuple[str, Any]] = [("$", obj)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}.{k}", v) for k, v in reversed(node.items()))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, bool):
            continue
        elif isinstance(node, int) and not -_JAVA_LONG <= node < _JAVA_LONG:
            digits = len(str(abs(node)))
            return path.removeprefix("$."), f"an integer of {digits} digits"
        elif isinstance(node, float) and not math.isfinite(node):
            return path.removeprefix("$."), f"{node} is not a finite number"
    return None


def parse_loads(obj: Any, path: str) -> dict[int, LoadSample]:
    """``LOAD.json``: segment id -> load record."""
    if not isinstance(obj, Mapping):
        raise InputError(f"load {path}: expected an object keyed by segment id")
    loads: dict[int, LoadSample] = {}
    for key, record in obj.items():
        try:
            sid = int(key)
        except ValueError:
            raise InputError(f"load {path}: key {key!r} is not a segment id") from None
        try:
            loads[sid] = load_sample_from_json(record, f"load[{key}]")
        except ModelError as exc:
            raise InputError(f"load {path}: {exc}") from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise InputError(f"load {path}: load[{key}]: {exc}") from None
    return loads


def parse_consumers(obj: Any, path: str) -> dict[str, int]:
    """``C.json``: subscription -> consumer count, or -> {"type", "consumers"}.

    QUEUE subscriptions do not count (DESIGN §6: STREAM/CHECKPOINT only).
    """
    if not isinstance(obj, Mapping):
        raise InputError(f"consumers {path}: expected an object keyed by subscription")
    counts: dict[str, int] = {}
    for sub, entry in obj.items():
        kind, count = "STREAM", entry
        if isinstance(entry, Mapping):
            kind, count = entry.get("type", "STREAM"), entry.get("consumers")
            kind = kind.upper() if isinstance(kind, str) else kind
            if kind not in SUBSCRIPTION_TYPES:
                raise InputError(
                    f"consumers {path}: {sub}: type {kind!r} is not one of "
                    + ", ".join(SUBSCRIPTION_TYPES)
                )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InputError(
                f"consumers {path}: {sub}: expected a consumer count >= 0, got {count!r}"
            )
        if kind != "QUEUE":
            counts[str(sub)] = count
    return counts


def _parse_layout(obj: Any, path: str) -> Any:
    try:
        return layout_mod.check(layout_from_json(obj))
    except (ModelError, layout_mod.LayoutError) as exc:
        raise InputError(f"layout {path}: {exc}") from None
    except (ValueError, TypeError, OverflowError) as exc:
        raise InputError(f"layout {path}: {exc}") from None


def cmd_decide(args: argparse.Namespace) -> int:
    from_stdin = [
        f"--{name}" for name in ("layout", "load", "consumers") if getattr(args, name) == STDIN
    ]
    if args.config == STDIN:
        from_stdin.append("--config")
    if len(from_stdin) > 1:  # the second would read an empty stream ("not JSON")
        raise OperatorError(
            f"only one input can be read from stdin ('-'), got {' and '.join(from_stdin)}",
            exit_code=EXIT_USAGE,
            setting=from_stdin[1],
        )
    try:
        topic_layout = _parse_layout(_read_json(args.layout, "layout"), _display(args.layout))
        loads = parse_loads(_read_json(args.load, "load"), _display(args.load))
        consumers = (
            parse_consumers(_read_json(args.consumers, "consumers"), _display(args.consumers))
            if args.consumers
            else {}
        )
    except InputError as exc:
        raise OperatorError(str(exc), exit_code=EXIT_USAGE) from None
    settings = load_config(args.config, exit_code=EXIT_USAGE).policy
    policy = resolve_policy(settings, topic_layout.auto_scale_policy)
    decision = decide(
        topic_layout, loads, consumers, policy, args.now_ms, args.last_split_ms, args.last_merge_ms
    )
    print(json.dumps(decision_to_json(decision)))
    return EXIT_OK


# --- config ---------------------------------------------------------------------------


def load_config(path: str | None, *, exit_code: int) -> config_mod.Config:
    """The validated config at ``path`` (``-`` = stdin; None = defaults) with env overrides.

    Raises:
        ConfigInvalid: one line per error, each ``<file>: <setting>: <why>``; the
            file is named once, however the error arose.
    """
    shown = "<defaults>" if path is None else _display(path)
    if path is None:
        text = ""
    else:
        try:
            text = _read_text(path, "config")
        except InputError as exc:
            raise ConfigInvalid([str(exc).removeprefix("config ")], exit_code) from None
        if config_mod.is_empty(text):  # as the daemon refuses it at start and on SIGHUP
            raise ConfigInvalid([f"{shown}: {config_mod.EMPTY_FILE}"], exit_code)
    try:
        return config_mod.load(text, os.environ)
    except config_mod.ConfigError as exc:
        raise ConfigInvalid([f"{shown}: {error}" for error in exc.errors], exit_code) from None


def checked_config(path: str) -> config_mod.Config:
    """The config of ``run`` and ``status``: valid, and every file it names usable."""
    cfg = load_config(path, exit_code=EXIT_USAGE)
    problems = config_file_errors(cfg)
    if problems:
        raise ConfigInvalid([f"{_display(path)}: {p}" for p in problems], EXIT_USAGE)
    return cfg


def cmd_check_config(args: argparse.Namespace) -> int:
    path: str | None = args.file or os.environ.get(config_mod.CONFIG_PATH_ENV)
    if not path:
        raise OperatorError(
            f"no FILE given and {config_mod.CONFIG_PATH_ENV} is not set", exit_code=EXIT_USAGE
        )
    cfg = load_config(path, exit_code=EXIT_FAILED)
    problems = config_file_errors(cfg)
    if problems:
        raise ConfigInvalid([f"{_display(path)}: {p}" for p in problems], EXIT_FAILED)
    print(f"{_display(path)}: ok")
    return EXIT_OK


def _config_path(args: argparse.Namespace) -> str:
    path: str | None = args.config or os.environ.get(config_mod.CONFIG_PATH_ENV)
    if not path:
        raise OperatorError(
            f"--config FILE (or {config_mod.CONFIG_PATH_ENV}) is required",
            exit_code=EXIT_USAGE,
            setting="--config",
        )
    return path


# --- daemon commands ------------------------------------------------------------------


class _EarlyHangups:
    """Counts the SIGHUPs that reach ``run`` before its daemon listens for them.

    SIGHUP's default action ends the process, and the daemon's own handler is only
    installed once its modules are imported and its loop runs (a second or so): a
    reload asked for meanwhile (``systemctl reload``, a config-map watcher) killed
    it. :func:`cmd_run` installs this first; the handler only counts, and the daemon
    (:class:`~controllerd.daemon.runtime.Daemon`) decides: a SIGHUP that came before
    it read the config file is answered by that read, a later one by a reload as
    soon as it listens. The interpreter's own start and this module's imports come
    before any code of ours runs, so a SIGHUP then still ends it: about 0.1 s from
    exec with byte-compiled modules (a wheel's install compiles them; so does
    ``./dev.sh``), 0.35 s without (seen in /proc's SigCgt, seven starts each).
    """

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1

    def seen(self) -> int:
        return self.count


def cmd_run(args: argparse.Namespace) -> int:
    hangups = _EarlyHangups()
    signal.signal(signal.SIGHUP, hangups)  # first: the imports below take a second

    import anyio

    from controllerd.daemon import runtime

    path = _config_path(args)
    if path == "-" or is_special(path):
        raise OperatorError(
            "run needs a regular config file, not standard input, a pipe or a device: "
            "SIGHUP reads it again",
            exit_code=EXIT_USAGE,
            setting="--config",
        )
    checked_config(path)  # refuse an invalid config or a missing file before starting anything
    run = functools.partial(runtime.run, path, dict(os.environ), early_hangups=hangups.seen)
    result: int = anyio.run(run)
    return result


def cmd_status(args: argparse.Namespace) -> int:
    import anyio

    from controllerd.daemon import status as status_mod
    from controllerd.daemon.logs import configure_logging

    cfg = checked_config(_config_path(args))
    configure_logging(cfg.logging.level, cfg.logging.format)
    output = args.output or ("table" if _isatty(sys.stdout) else "json")
    state = anyio.run(functools.partial(status_mod.read_status, cfg, within=args.timeout))
    if output == "table":
        print(status_mod.render_table(state))
    else:
        print(json.dumps(state))
    why = status_mod.problem(state, cfg)
    if why is not None:
        print(f"{PROG}: {why}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def cmd_refbroker(args: argparse.Namespace) -> int:
    from controllerd.refbroker.main import cmd_refbroker as refbroker

    # loaded once here: stdin ('-') cannot be read twice
    config = load_config(args.config, exit_code=EXIT_USAGE) if args.config else None
    result: int = refbroker(args, config)
    return result


def cmd_demo(args: argparse.Namespace) -> int:
    from controllerd.demo import cmd_demo as demo

    result: int = demo(args.keep)
    return result


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab  # here, not at the top: ~30 ms that no other command needs

    parser = build_parser()
    for action in _all_actions(parser):
        if getattr(action, _TAKES_FILE, False):
            action.complete = shtab.FILE  # type: ignore[attr-defined]
    print(shtab.complete(parser, shell=args.shell), end="")
    return EXIT_OK


def _all_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


# --- the parser -----------------------------------------------------------------------

#: ``--help`` examples of every subcommand (the pipeline's included), shown as its epilog.
EXAMPLES: Final[Mapping[str, str]] = {
    "decide": """\
  controllerd decide --layout examples/layout.json --load examples/load.json \\
      --consumers examples/consumers.json --now-ms 1760000400000
  controllerd decide --layout L.json --load - --now-ms "$(date +%s000)" < LOAD.json""",
    "run": """\
  controllerd run --config /etc/controllerd/controllerd.toml
  CONTROLLERD_CONFIG=/etc/controllerd/controllerd.toml controllerd run""",
    "status": """\
  controllerd status --config /etc/controllerd/controllerd.toml
  controllerd status -o json | jq .fencing_token""",
    "demo": """\
  controllerd demo
  controllerd demo --keep""",
    "refbroker": """\
  controllerd refbroker --etcd http://127.0.0.1:2379 --kafka 127.0.0.1:9092 \\
      --listen 127.0.0.1:8080 --config controllerd.toml""",
    "check-config": """\
  controllerd check-config /etc/controllerd/controllerd.toml
  CONTROLLERD_POLICY__MAX_SEGMENTS=0 controllerd check-config my.toml
  kubectl get cm controllerd-config -o jsonpath='{.data.controllerd\\.toml}' \\
      | controllerd check-config -""",
    "completion": """\
  controllerd completion bash > /etc/bash_completion.d/controllerd
  controllerd completion zsh > "${fpath[1]}/_controllerd\"""",
    "backtest": """\
  controllerd backtest --traces traces/nab/ --variants examples/variants.toml --out /tmp/bt
  controllerd backtest --traces /tmp/recorded --engine spark --out /tmp/bt""",
    "tune": """\
  controllerd tune --traces traces/nab traces/aws --grid examples/tune-grid.toml \\
      --cv loto --out /tmp/tune
  controllerd tune --traces traces/nab --grid examples/tune-grid.toml --cv time:0.5 \\
      --out /tmp/tune --reuse /tmp/tune/metrics.csv""",
    "record": """\
  controllerd record --config /etc/controllerd/controllerd.toml --out /tmp/recorded""",
}

#: Exit statuses of each subcommand, beyond 0 (success), 70 (bug) and 130 (Ctrl-C).
COMMAND_EXITS: Final[Mapping[str, tuple[int, ...]]] = {
    "decide": (2,),
    "run": (2, 3),
    "status": (1, 2, 3),
    "check-config": (1, 2),
    "demo": (2, 3),
    "refbroker": (2, 3),
    "completion": (2,),
    "backtest": (2, 3),
    "tune": (2, 3),
    "record": (2, 3),
}


def _epilog(command: str) -> str:
    statuses = ", ".join(f"{code} {EXIT_STATUSES[code]}" for code in COMMAND_EXITS[command])
    return f"examples:\n{EXAMPLES[command]}\n\nexit status: 0 success; {statuses}"


def _main_epilog() -> str:
    lines = [f"  {code:>3}  {text}" for code, text in EXIT_STATUSES.items()]
    return (
        "exit statuses (docs/operations.md has them per command):\n"
        + "\n".join(lines)
        + f"\n\n{DEBUG_ENV}=1 prints the traceback of an internal error."
    )


_TAKES_FILE: Final = "_controllerd_takes_file"


def _file(action: argparse.Action) -> None:
    """Mark the option as taking a file name, for shell completion (cmd_completion)."""
    setattr(action, _TAKES_FILE, True)


def _config_option(parser: argparse.ArgumentParser, required_hint: bool) -> None:
    hint = f" (default: ${config_mod.CONFIG_PATH_ENV})" if required_hint else ""
    _file(parser.add_argument("--config", metavar="FILE", help=f"controllerd.toml{hint}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Split, merge and garbage-collect the segments of scalable topics.",
        epilog=_main_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version, nargs=0, help="print the version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            description=description or help_text[0].upper() + help_text[1:] + ".",
            epilog=_epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add("decide", "run the policy once on files; print the decision as JSON")
    _file(
        p.add_argument(
            "--layout",
            required=True,
            metavar="L.json",
            help="ScalableTopicMetadata JSON (- = stdin)",
        )
    )
    _file(
        p.add_argument(
            "--load",
            required=True,
            metavar="LOAD.json",
            help="segment id -> load record (- = stdin)",
        )
    )
    _file(
        p.add_argument(
            "--consumers", metavar="C.json", help="subscription -> consumer count (- = stdin)"
        )
    )
    _file(
        p.add_argument(
            "--config", metavar="FILE", help="controllerd.toml with [policy] (default: defaults)"
        )
    )
    p.add_argument(
        "--now-ms", required=True, type=int, metavar="N", help="the decision time, Unix ms"
    )
    p.add_argument(
        "--last-split-ms", type=int, metavar="N", help="when the topic last split, Unix ms"
    )
    p.add_argument(
        "--last-merge-ms", type=int, metavar="N", help="when the topic last merged, Unix ms"
    )
    p.set_defaults(func=cmd_decide)

    p = add("run", "run a controller replica (leader-elected through etcd)")
    _config_option(p, True)
    p.set_defaults(func=cmd_run)

    p = add(
        "status",
        "print who leads the cluster (or owns each shard) and the fencing token",
        "Read the election keys from etcd once and print who leads the cluster and its "
        "fencing token (sharded mode: who owns each shard). Exits 1 when nobody leads.",
    )
    _config_option(p, True)
    p.add_argument(
        "-o",
        "--output",
        choices=("json", "table"),
        help="output format (default: table on a terminal, else json; json is the stable one)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=3.0,
        metavar="SECONDS",
        help="give up when etcd has not answered for this long (default: 3)",
    )
    p.set_defaults(func=cmd_status)

    p = add("demo", "run everything on 127.0.0.1 and show it split, merge, GC")
    p.add_argument("--keep", action="store_true", help="keep the work directory with the logs")
    p.set_defaults(func=cmd_demo)

    p = add("refbroker", "run the reference broker (admin API over etcd + Kafka)")
    add_refbroker_arguments(p)  # one definition, shared with python -m controllerd.refbroker.main
    for action in p._actions:
        if action.dest in ("config", "token_file"):
            _file(action)
    p.set_defaults(func=cmd_refbroker)

    p = add(
        "check-config",
        "validate a config and every file it names; print every error",
        "Validate a config file as `run` would: every setting, the CONTROLLERD_* "
        "overrides, and every file it names (secrets, CA bundles, client certificates "
        "and keys) opened and loaded. Prints FILE: ok, or one line per error, each "
        "naming its setting.",
    )
    _file(
        p.add_argument(
            "file",
            nargs="?",
            metavar="FILE",
            help=f"the config file; - reads stdin (default: ${config_mod.CONFIG_PATH_ENV})",
        )
    )
    p.set_defaults(func=cmd_check_config)

    p = add("completion", "print a shell completion script")
    p.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell to complete for")
    p.set_defaults(func=cmd_completion)

    add_pipeline_commands(sub)  # backtest, tune, record (heavy imports happen inside them)
    for name, subparser in sub.choices.items():
        if subparser.epilog is None and name in EXAMPLES:
            subparser.epilog = _epilog(name)
            subparser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def _version() -> str:
    from importlib import metadata  # ~50 ms: only when asked

    try:
        return metadata.version("controllerd")
    except metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``, reading the package metadata only when it is asked for."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


# --- the one handler ------------------------------------------------------------------


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, such as anyio task groups raise."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _report(exc: BaseException) -> int:
    """Print what ``exc`` means to an operator; return the exit status."""
    leaves = _leaves(exc)
    for leaf in leaves:
        if isinstance(leaf, KeyboardInterrupt):
            return EXIT_INTERRUPTED
    for leaf in leaves:
        if isinstance(leaf, OperatorError):
            print(f"{PROG}: {leaf.line()}", file=sys.stderr)
            return leaf.exit_code
        if isinstance(leaf, ConfigInvalid):
            for line in leaf.lines:
                print(line, file=sys.stderr)
            return leaf.exit_code
    for leaf in leaves:
        if isinstance(leaf, SystemExit) and isinstance(leaf.code, int | None):
            return leaf.code or EXIT_OK
    print(f"{PROG}: {internal_error_line(leaves[0])}", file=sys.stderr)
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exception(exc)
    return EXIT_SOFTWARE


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every outcome is an exit status (:mod:`controllerd.errors`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # usage errors: argparse's message, exit 2
    if extra:
        stray = next((a for a in extra if a.endswith(".toml")), None)
        hint = f" (a config file goes after --config: --config {stray})" if stray else ""
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except SystemExit:
        raise
    except BrokenPipeError:
        # The reader went away (`controllerd status | head -1`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except BaseException as exc:  # the one place that turns what escapes into a status
        return _report(exc)


if __name__ == "__main__":
    sys.exit(main())
