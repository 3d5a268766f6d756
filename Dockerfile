# Multi-stage: build the wheel with build tools, install it into a clean slim image.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY controllerd ./controllerd
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --no-create-home controllerd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY config/controllerd.toml /etc/controllerd/controllerd.toml
USER 10001
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2).status != 200)"
ENTRYPOINT ["controllerd"]
CMD ["run", "--config", "/etc/controllerd/controllerd.toml"]
