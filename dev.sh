#!/usr/bin/env bash
# One entry point for a fresh Debian machine with Python 3.11:
#   ./dev.sh run    set everything up, then run the embedded default (controllerd demo):
#                   etcd, Kafka (tansu), the reference broker and two controllerd replicas
#   ./dev.sh test   set everything up, then lint, type-check and run the whole test suite
#                   (pytest-xdist, three workers; CONTROLLERD_TEST_WORKERS overrides)
# Set-up is idempotent: system packages are installed only when missing, and the
# virtualenv (.venv) is refreshed only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")"

need_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

setup_system() {
    local missing=()
    command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)             # tests, demo
    command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)    # unit verification
    command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)  # Spark
    command -v promtool >/dev/null 2>&1 || missing+=(prometheus)      # promtool: alert rules
    if [ ${#missing[@]} -gt 0 ]; then
        echo "dev.sh: installing ${missing[*]}" >&2
        need_root apt-get update -qq
        DEBIAN_FRONTEND=noninteractive need_root apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null
        # Only promtool is wanted from the prometheus package, not a server on :9090.
        if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
            need_root systemctl disable --now prometheus >/dev/null 2>&1 || true
        fi
    fi
    # kubectl (with its built-in kustomize) renders config/kubernetes/ in the tests; the
    # machine images have it, Debian's own is too old (no kustomize components).
    command -v kubectl >/dev/null 2>&1 || echo "dev.sh: kubectl >= 1.21 is needed by tests/test_deploy.py" >&2
}

setup_python() {
    local py="${PYTHON:-}"
    if [ -z "$py" ]; then
        for candidate in python3.11 python3; do
            if command -v "$candidate" >/dev/null 2>&1; then py="$candidate"; break; fi
        done
    fi
    [ -d .venv ] || "$py" -m venv .venv
    local stamp=.venv/.controllerd-installed
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        # Python 3.11's own pip installs an editable pyproject package (PEP 660), so it
        # is not upgraded first. Modules are byte-compiled here, once: where
        # PYTHONDONTWRITEBYTECODE is set, nothing else would, and every process the
        # tests start would compile pandas and PySpark again (the suite took 40% longer).
        .venv/bin/python -m pip install -q -e '.[dev,spark]'
        touch "$stamp"
    fi
}

compile_sources() {
    # Our own modules are byte-compiled too, as site-packages are at install: where
    # PYTHONDONTWRITEBYTECODE is set nothing else would, and every process the tests
    # start (daemons, brokers, CLIs) compiled them again, ~0.3 s of CPU each (the suite
    # took 11% longer). Python checks a .pyc against its source's time: an edited file
    # is compiled afresh, never run stale. Arguments: the trees to compile.
    .venv/bin/python -m compileall -q "$@"
}

cmd="${1:-}"
case "$cmd" in
    test)
        shift
        setup_system
        setup_python
        compile_sources controllerd tests bench
        # The replay's numba kernels, compiled into their disk cache once, before the
        # workers and the backtests they start each compile them (~6 s of CPU each).
        (.venv/bin/python -m tests.support.warm_kernels >/dev/null 2>&1 || true) &
        .venv/bin/ruff check controllerd tests bench
        # The type and import checks run beside the tests, on the CPU the tests leave
        # idle while they wait on etcd and brokers; their output follows the tests'.
        checks_log=$(mktemp)
        (.venv/bin/mypy && .venv/bin/lint-imports) >"$checks_log" 2>&1 &
        checks=$!
        trap 'kill "$checks" 2>/dev/null || true' EXIT
        # Three workers by default, on 2 cores: most tests wait on etcd, brokers and
        # subprocesses, and with two workers the cores stood ~30% idle; an idle worker
        # steals tests from the others, so none waits alone on a long file at the end.
        # CONTROLLERD_TEST_WORKERS=0 runs everything in this process. Tests marked
        # serial (rates measured on real traffic) run afterwards, alone. Exit status 5
        # is "no test selected".
        tests_ok=0
        .venv/bin/python -m pytest -n "${CONTROLLERD_TEST_WORKERS:-3}" --dist worksteal \
            -m "not serial" "$@" || tests_ok=$?
        [ "$tests_ok" -ne 5 ] || tests_ok=0
        checks_ok=0
        wait "$checks" || checks_ok=$?
        cat "$checks_log"
        rm -f "$checks_log"
        [ "$checks_ok" -eq 0 ] || { echo "dev.sh: mypy or lint-imports failed" >&2; exit "$checks_ok"; }
        [ "$tests_ok" -eq 0 ] || exit "$tests_ok"
        .venv/bin/python -m pytest -m serial "$@" || [ $? -eq 5 ]
        ;;
    run)
        shift
        setup_system
        setup_python
        compile_sources controllerd  # the demo runs no test or bench module
        exec .venv/bin/controllerd demo "$@"
        ;;
    *)
        echo "usage: ./dev.sh run|test [args...]" >&2
        exit 2
        ;;
esac
