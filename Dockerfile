# syntax=docker/dockerfile:1
# Tandem DRA driver image: `tandem-driver run` is what the DaemonSet starts.
#
#   podman build -t tandem-driver:0.1.0 .        (or: docker build -t tandem-driver:0.1.0 .)
#
# Two stages: the builder turns the hash-pinned lock files into wheels and builds Tandem's own
# wheel; the final stage installs only those wheels, from a bind mount, so neither the wheels
# nor pip's build tooling end up in a layer.
#
# Base image: an exact CPython patch release on an exact Debian release. To pin it by digest as
# well (recommended for releases), resolve the tag once on a machine that reaches the registry:
#   skopeo inspect --format '{{.Digest}}' docker://docker.io/library/python:3.11.11-slim-bookworm
# (or `podman pull` it and `podman image inspect --format '{{.Digest}}'`), then set
#   PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm@sha256:<that digest>
# A manifest-list digest pins every architecture at once.
ARG PYTHON_IMAGE=docker.io/library/python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# Dependencies first, so that a code change does not refetch them. --require-hashes refuses any
# file whose hash is not in the lock; --only-binary refuses to compile anything (every pinned
# dependency ships wheels for CPython 3.11 on manylinux x86_64 and aarch64).
COPY requirements-build.lock requirements.lock ./
RUN python -m pip install --require-hashes --only-binary=:all: -r requirements-build.lock \
 && python -m pip wheel --require-hashes --only-binary=:all: --wheel-dir /wheels -r requirements.lock
COPY pyproject.toml README.md ./
COPY driver ./driver
COPY cdi ./cdi
# The wheel also carries the simulation and the demo (`tandem-driver demo` from a plain pip
# install); the daemon never imports them.
COPY sim ./sim
COPY demo ./demo
# The build backend comes from requirements-build.lock (installed above), not from an unpinned
# isolated build environment.
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/tandem .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-driver" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs and RDMA (RoCE) NICs" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Pinned dependencies, hash-checked a second time against the same lock, then Tandem itself.
# pip compiles the .py files at install time, so the DaemonSet's read-only root filesystem costs
# no start-up time.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=bind,source=requirements.lock,target=/tmp/requirements.lock \
    python -m pip install --no-index --find-links /wheels --require-hashes -r /tmp/requirements.lock \
 && python -m pip install --no-index --no-deps /wheels/tandem/tandem_dra-*.whl \
 && tandem-driver --help >/dev/null
# The DaemonSet runs this image as root (runAsUser: 0): the driver writes into root-owned kubelet
# and CDI directories and opens device nodes. Anything else (`tandem-driver demo`, --help,
# debugging) runs as this unprivileged user by default.
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid tandem --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tandem
USER 10001:10001
ENTRYPOINT ["tandem-driver"]
CMD ["run"]
