# syntax=docker/dockerfile:1
# webhook-gateway image, published as ghcr.io/<owner>/webhook-gateway:<version> where <version> is
# gateway.__version__ (what `webhook-gateway --version` prints):
#   docker build --build-arg VERSION=0.1.0 -t ghcr.io/<owner>/webhook-gateway:0.1.0 .
#
# Stage "build" turns the project and its dependencies into wheels and installs them under
# /install; the final stage copies only that tree onto a clean slim Python. No compiler, no build
# front-end and no source tree reach the final image.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN python -m pip wheel --wheel-dir /wheels . \
 && python -m pip install --no-index --find-links /wheels --prefix /install /wheels/webhook_gateway-*.whl

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="webhook-gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="An asynchronous admission-webhook gateway for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /install /usr/local
# A numeric, non-root user (no passwd entry needed): Kubernetes can check runAsNonRoot against it.
USER 65532:65532
WORKDIR /
EXPOSE 8443 9090
# Kubernetes ignores HEALTHCHECK and uses the Deployment's probes on /healthz and /readyz
# (deploy/base/deployment.yaml); this one serves plain `docker run`. It skips certificate
# verification on purpose: it only asks whether this process answers on its own port.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import ssl, urllib.request as r; c = ssl.create_default_context(); c.check_hostname = False; c.verify_mode = ssl.CERT_NONE; r.urlopen('https://127.0.0.1:8443/healthz', context=c, timeout=4)"]
ENTRYPOINT ["webhook-gateway"]
CMD ["--config", "/etc/webhook-gateway/config", \
     "--bind", "0.0.0.0:8443", \
     "--certfile", "/etc/webhook-gateway/tls/tls.crt", \
     "--keyfile", "/etc/webhook-gateway/tls/tls.key"]
