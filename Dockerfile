# syntax=docker/dockerfile:1
# Tandem DRA driver image: `tandem-driver run` is what the DaemonSet starts.
#
# It holds the driver and nothing else: the packages `driver` (the daemon, `tandem-driver`,
# `tandemctl`) and `cdi`, with their pinned runtime dependencies. The simulation (`sim`) and the
# demo (`demo`) are left out, with their extra dependencies: a privileged pod on every node carries
# no code it does not run. `tandem-driver demo` therefore does not work in this image; run it in a
# checkout, with `hack/demo.sh` or after `pip install '.[sim]'`.
#
#   podman build --build-arg TANDEM_COMMIT="$(git rev-parse HEAD)" \
#     --build-arg TANDEM_CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" -t tandem-driver:0.2.0.dev0 .
#   (or docker build with the same arguments)
#
# Those build args say what the image was built from (hack/cluster/build.sh passes them): they
# become its OCI labels and, as TANDEM_COMMIT and TANDEM_CREATED in its environment, what
# `tandem-driver --version` and the daemon's first log line report, since the image has no .git to
# ask. Without them the labels are empty and the commit reads `unknown`.
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
# The packages setuptools finds here are the ones copied: sim/ and demo/ are not (and
# .dockerignore keeps them out of the context), so the wheel built below holds only the driver.
COPY pyproject.toml README.md ./
COPY driver ./driver
COPY cdi ./cdi
# The build backend comes from requirements-build.lock (installed above), not from an unpinned
# isolated build environment. SHA256SUMS lists every wheel the final stage installs (see there).
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/tandem . \
 && cd /wheels && sha256sum *.whl tandem/*.whl >/wheels/SHA256SUMS

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tandem-driver" \
      org.opencontainers.image.description="Kubernetes DRA driver for NVIDIA GPUs and RDMA (RoCE) NICs" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The checksums of the wheels, copied (a few hundred bytes, kept as a record of what the image
# installed): buildah (podman build) keys its layer cache for the RUN below by the instruction
# text, not by the content of a bind mount from another stage, so without a COPY, which it keys by
# content, a rebuild after a code change would reuse the old install layer and the old driver.
COPY --from=builder /wheels/SHA256SUMS /usr/local/share/tandem/wheels.sha256
# The wheels are checked against those sums; pinned dependencies are hash-checked a second time
# against the same lock, then Tandem itself is installed. pip compiles the .py files at install
# time, so the DaemonSet's read-only root filesystem costs no start-up time.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    --mount=type=bind,source=requirements.lock,target=/tmp/requirements.lock \
    (cd /wheels && sha256sum --quiet -c /usr/local/share/tandem/wheels.sha256) \
 && python -m pip install --no-index --find-links /wheels --require-hashes -r /tmp/requirements.lock \
 && python -m pip install --no-index --no-deps /wheels/tandem/tandem_dra-*.whl \
 && tandem-driver --help >/dev/null
# The DaemonSet runs this image as root (runAsUser: 0): the driver writes into root-owned kubelet
# and CDI directories and opens device nodes. Anything else (--help, debugging) runs as this
# unprivileged user by default.
RUN groupadd --system --gid 10001 tandem \
 && useradd --system --uid 10001 --gid tandem --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tandem
USER 10001:10001
# What this image was built from (see the top). Declared last, so that a new commit or build time
# changes only the metadata below, never the install layers above (a RUN after an ARG is keyed by
# its value). TANDEM_VERSION defaults to pyproject.toml's version (tests/unit/test_dockerfile.py
# keeps the two equal); TANDEM_SOURCE is the repository's URL, for whoever publishes the image.
ARG TANDEM_VERSION=0.2.0.dev0
ARG TANDEM_COMMIT=
ARG TANDEM_CREATED=
ARG TANDEM_SOURCE=
LABEL org.opencontainers.image.version="${TANDEM_VERSION}" \
      org.opencontainers.image.revision="${TANDEM_COMMIT}" \
      org.opencontainers.image.created="${TANDEM_CREATED}" \
      org.opencontainers.image.source="${TANDEM_SOURCE}"
ENV TANDEM_COMMIT="${TANDEM_COMMIT}" \
    TANDEM_CREATED="${TANDEM_CREATED}"
ENTRYPOINT ["tandem-driver"]
CMD ["run"]
