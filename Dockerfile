# syntax=docker/dockerfile:1
#
# dra-gpu-exporter image: a distroless Python 3.11 runtime with the package installed by
# `pip install --target` in a Debian 12 builder of the same Python (ABI-identical, so compiled
# wheels such as grpcio and protobuf run unchanged). The final image has no shell, no package
# manager, no pip and no compiler.
#
#   docker build -t ghcr.io/dra-gpu-exporter/dra-gpu-exporter:0.1.0 \
#     --build-arg VERSION=0.1.0 --build-arg REVISION=$(git rev-parse HEAD) .
#
# Bases are pinned by digest (multi-arch index digests). To update:
#   crane digest debian:12.12-slim ; crane digest gcr.io/distroless/python3-debian12:nonroot
#
# Root: the image runs as uid 65532. The DaemonSet overrides that with uid 0 (and drops every
# capability) for one reason: connect() to the kubelet's root-owned pod-resources socket needs
# write permission on it. NVML works as any user (/dev/nvidia* are 0666); AMD SMI needs the
# render/video groups or the DRA admin-access claim (docs/deploy.md, "Device access").

ARG BUILDER_IMAGE=debian:12.12-slim@sha256:d5d3f9c23164ea16f31852f95bd5959aad1c5e854332fe00f7b3a20fcc9f635c
ARG RUNTIME_IMAGE=gcr.io/distroless/python3-debian12:nonroot@sha256:7d1042ce588ab97019fe95c24ffca7bc5a82ccdac572511d5e09bda4435c89c5

FROM ${BUILDER_IMAGE} AS build
ARG DEBIAN_FRONTEND=noninteractive
# Debian's python3 is the same 3.11 the distroless runtime ships; python3-venv provides pip.
# Versions are not pinned: the digest-pinned base fixes the Debian release, and bookworm's archive
# drops superseded versions, so an exact pin would break the build at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pip-venv
WORKDIR /src
COPY pyproject.toml README.md ./
# Only the product: the simulator (drasim/, behind `dra-gpu-exporter demo`) stays out of the image.
COPY exporter ./exporter
# --target: a plain directory of packages, importable with PYTHONPATH and free of any interpreter
# path (a venv would hard-code the builder's). The [amd] extra is pure Python; it loads the host's
# libamd_smi.so at run time when mounted.
RUN /opt/pip-venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        --target /opt/dra-gpu-exporter ".[amd]" \
    && rm -rf /opt/dra-gpu-exporter/bin \
    && python3 -m compileall -q /opt/dra-gpu-exporter

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="dra-gpu-exporter" \
      org.opencontainers.image.description="Kubernetes node agent: GPU metrics attributed to DRA ResourceClaims, GPU health and DeviceTaintRule remediation" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/dra-gpu-exporter/dra-gpu-exporter" \
      org.opencontainers.image.url="https://github.com/dra-gpu-exporter/dra-gpu-exporter" \
      org.opencontainers.image.documentation="https://github.com/dra-gpu-exporter/dra-gpu-exporter/blob/main/docs/deploy.md" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="dra-gpu-exporter" \
      org.opencontainers.image.base.name="gcr.io/distroless/python3-debian12:nonroot"
COPY --from=build /opt/dra-gpu-exporter /opt/dra-gpu-exporter
ENV PYTHONPATH=/opt/dra-gpu-exporter \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 9402
ENTRYPOINT ["/usr/bin/python3.11", "-m", "exporter"]
