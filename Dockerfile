# kiloserve gateway image (also runs `kiloserve engine` twins and, later, the agent).
#
#   docker build -t kiloserve/gateway:0.1.0 \
#     --build-arg VCS_REF=$(git rev-parse --short HEAD) .
#   docker run --rm -p 8000:8000 -v $PWD/gateway.yaml:/etc/kiloserve/gateway.yaml:ro \
#     kiloserve/gateway:0.1.0
#
# Not built in this repository's CI (no Docker engine there): tests/unit/
# test_deploy_manifests.py parses it and checks its structure (docs/deployment.md).
# Two stages: build a wheel, then install it alone into a slim runtime as a non-root user.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY src ./src
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="kiloserve gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILOSERVE_IMAGE_VERSION=${VERSION} KILOSERVE_IMAGE_REVISION=${VCS_REF}
COPY --from=build /wheels /wheels
RUN python -m pip install /wheels/*.whl && rm -rf /wheels \
    && groupadd --system --gid 10001 kiloserve \
    && useradd --system --uid 10001 --gid kiloserve --no-create-home kiloserve \
    && mkdir -p /etc/kiloserve
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=2s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2); sys.exit(0)"]
ENTRYPOINT ["kiloserve"]
CMD ["gateway", "-c", "/etc/kiloserve/gateway.yaml", "--host", "0.0.0.0"]
