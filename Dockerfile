# syntax=docker/dockerfile:1
# controllerd image. Build:  docker build -t controllerd:0.1.0 .
# Run:  docker run -v $PWD/controllerd.toml:/etc/controllerd/controllerd.toml:ro controllerd:0.1.0
# The built-in /etc/controllerd/controllerd.toml is the reference config (all defaults:
# etcd and ops HTTP on 127.0.0.1); mount your own. See docs/operations.md.
#
# Pin the base by digest in production: --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the controllerd wheel, then a virtualenv installed from wheels only -------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
# Compilers live only in this stage, for any dependency without a binary wheel for the
# target platform; tini (static build) is copied into the final image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential tini \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controllerd ./controllerd
# /wheels: controllerd-<version>-py3-none-any.whl and every dependency as a wheel.
RUN pip wheel --wheel-dir /wheels .
# The venv has no pip: nothing in the final image can build or install packages.
RUN python -m venv --without-pip /opt/controllerd \
 && pip --python /opt/controllerd/bin/python install --no-index --find-links /wheels controllerd \
 && /opt/controllerd/bin/controllerd --help >/dev/null

# --- runtime: slim base, the venv, a non-root user ------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="controllerd" \
      org.opencontainers.image.description="Leader-elected controller that splits, merges and garbage-collects the segments of scalable topics" \
      org.opencontainers.image.licenses="Apache-2.0"
# The base image's own pip/setuptools/wheel go too: no build or install tooling at runtime.
RUN python -m pip uninstall --yes pip setuptools wheel \
 && groupadd --system --gid 10001 controllerd \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin controllerd
COPY --from=build /usr/bin/tini-static /usr/bin/tini
COPY --from=build /opt/controllerd /opt/controllerd
COPY config/controllerd.toml /etc/controllerd/controllerd.toml
# Bytecode was compiled at build time; the root filesystem may be read-only.
ENV PATH=/opt/controllerd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
USER 10001:10001
EXPOSE 9464
# Liveness of the event loop. Reads [http] listen from the same config and environment
# as the daemon, so a changed port or address needs no change here.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; from controllerd.config import load_file; h = load_file(os.environ.get('CONTROLLERD_CONFIG', '/etc/controllerd/controllerd.toml'), os.environ).http; host = {'0.0.0.0': '127.0.0.1', '::': '::1', '': '127.0.0.1'}.get(h.host, h.host); host = f'[{host}]' if ':' in host else host; urllib.request.urlopen(f'http://{host}:{h.port}/healthz', timeout=4)"]
# tini as PID 1 forwards SIGTERM/SIGHUP to controllerd and reaps zombies; the daemon
# handles SIGTERM (graceful, <= 10 s) and SIGHUP (reload).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "controllerd"]
CMD ["run", "--config", "/etc/controllerd/controllerd.toml"]
