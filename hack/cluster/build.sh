# Building the cluster's binaries and images; sourced by lib.sh.
# shellcheck shell=bash

: "${repo:?}" "${here:?}"

# The cache key covers everything that decides the binaries: the pinned versions (go.mod, go.sum),
# our own Go sources, the Go toolchain and the flags below.
build_key() {
  {
    cat "$here/go.mod" "$here/go.sum" "$here/pause/main.go"
    go version
    declare -f build_binaries build_runc
  } | sha256sum | cut -c1-16
}

find_build() {
  if [ -z "${BIN:-}" ]; then
    command -v go >/dev/null || { BIN=""; return 1; }
    BIN="$CACHE_ROOT/$(build_key)/bin"
  fi
  [ -f "$BIN/.complete" ]
}

module_version() {
  awk -v m="$1" '$1 == m && $2 ~ /^v/ {print $2; exit}' "$here/go.mod"
}

build_binaries() {
  command -v go >/dev/null || die "Go is needed to build the cluster (https://go.dev/dl/)"
  if find_build; then
    return 0
  fi
  local kube containerd ldflags p t0=$SECONDS
  kube="$(module_version k8s.io/kubernetes)"
  containerd="$(module_version github.com/containerd/containerd/v2)"
  # The components report the version they were built from, as a release build does.
  ldflags="-s -w"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ldflags+=" -X $p.gitVersion=$kube -X $p.gitMajor=$(echo "$kube" | cut -d. -f1 | tr -d v)"
    ldflags+=" -X $p.gitMinor=$(echo "$kube" | cut -d. -f2) -X $p.gitTreeState=clean"
  done
  ldflags+=" -X github.com/containerd/containerd/v2/version.Version=$containerd"
  say "building Kubernetes $kube, etcd, containerd $containerd (first time only; about 30 minutes on 2 cores)"
  mkdir -p "$BIN"
  # Static binaries without cgo: no C toolchain needed, and containerd drops only the btrfs
  # snapshotter, which this cluster does not use. runc is the one tool that needs cgo (below).
  local tools
  tools="$(cd "$here" && go list tool | grep -vx "$RUNC_MODULE")"
  # shellcheck disable=SC2086 # one package per word
  (cd "$here" && CGO_ENABLED=0 GOBIN="$BIN" GOFLAGS=-mod=readonly go install -trimpath -ldflags "$ldflags" $tools ./pause)
  # go.etcd.io/etcd/server/v3 installs as "server".
  mv "$BIN/server" "$BIN/etcd"
  build_runc
  touch "$BIN/.complete"
  say "built in $((SECONDS - t0))s into $BIN"
}

# runc, at the version go.mod pins: CDI netDevices (exclusive NICs) need an OCI runtime that
# implements runtime-spec 1.3 `linux.netDevices` (runc 1.3 and later; Debian 12's runc 1.1.5 does
# not). It needs cgo (its nsenter is C) and libseccomp (the `seccomp` build tag), as a distribution
# builds it; containerd's runc runtime is pointed at it (config/containerd.toml).
RUNC_MODULE=github.com/opencontainers/runc
build_runc() {
  local need=()
  command -v gcc >/dev/null || need+=(gcc)
  command -v pkg-config >/dev/null || need+=(pkg-config)
  pkg-config --exists libseccomp 2>/dev/null || need+=(libseccomp-dev)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]} from Debian (to build runc)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  (cd "$here" && CGO_ENABLED=1 GOBIN="$BIN" GOFLAGS=-mod=readonly go install -trimpath -tags seccomp \
    -ldflags "-s -w" "$RUNC_MODULE")
}

# The images pods need, made from files on this machine (no registry is reachable):
#   $PAUSE_IMAGE   the pod sandbox: our pause binary;
#   $TEST_IMAGE    tests and users: Debian's static busybox with its applets as links.
build_images() {
  find_build || die "binaries missing"
  local images="$BIN/../images" root
  [ -f "$images/busybox.tar" ] && [ -f "$images/pause.tar" ] && return 0
  [ -x /bin/busybox ] || die "/bin/busybox missing: apt-get install busybox-static"
  mkdir -p "$images"
  root="$(mktemp -d)"
  mkdir -p "$root/pause"
  cp "$BIN/pause" "$root/pause/pause"
  # shellcheck disable=SC2153 # PAUSE_IMAGE is lib.sh's
  python3 "$here/image.py" --name "$PAUSE_IMAGE" --rootfs "$root/pause" --entrypoint /pause --out "$images/pause.tar" >/dev/null
  mkdir -p "$root/busybox/bin" "$root/busybox/tmp" "$root/busybox/etc"
  cp /bin/busybox "$root/busybox/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/busybox/bin/$applet"
  done
  echo 'root:x:0:0:root:/root:/bin/sh' >"$root/busybox/etc/passwd"
  python3 "$here/image.py" --name "$TEST_IMAGE" --rootfs "$root/busybox" --cmd /bin/sh --out "$images/busybox.tar" >/dev/null
  rm -rf "$root"
}

# The Dockerfile's base image cannot be pulled here. Build an equivalent under the same name:
# Debian 12 (the base's release) with its CPython 3.11 and pip, `python` on PATH and no
# EXTERNALLY-MANAGED marker, as in the official image. Made once with debootstrap and cached.
BASE_IMAGE=docker.io/library/python:3.11.11-slim-bookworm
PODMAN=(podman --runtime /usr/sbin/runc --cgroup-manager cgroupfs)

build_base_image() {
  "${PODMAN[@]}" image exists "$BASE_IMAGE" && return 0
  local tar="$CACHE_ROOT/base/bookworm-python3.11.tar" root
  if [ ! -f "$tar" ]; then
    command -v debootstrap >/dev/null ||
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
    say "building a stand-in for $BASE_IMAGE with debootstrap (first time only)"
    mkdir -p "$CACHE_ROOT/base"
    root="$(mktemp -d)"
    debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$root" \
      http://deb.debian.org/debian >"$CACHE_ROOT/base/debootstrap.log" 2>&1 ||
      die "debootstrap failed: see $CACHE_ROOT/base/debootstrap.log"
    rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"
    rm -rf "$root"
  fi
  "${PODMAN[@]}" import -q --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tar" "$BASE_IMAGE" >/dev/null
}

# build_tandem_image TAG [COMMIT]: the project's Dockerfile, built with podman, as containerd's
# image TAG; prints the path of the archive to import. Without COMMIT, from the checkout as it is;
# with one, from that commit (an earlier release, for tests/cluster/test_upgrade.py), whose archive
# is cached by commit and tag: a release's image never changes, so it is built once per machine.
build_tandem_image() {
  local tag="$1" commit="${2:-}" out="$STATE/images" src="$repo" cached=""
  # This runs as root in a checkout a user may own, which git refuses unless told the checkout is
  # safe; a commit it cannot tell stays empty and the driver reports `unknown`.
  local git=(git -c safe.directory="$repo" -C "$repo")
  if [ -n "$commit" ]; then
    commit="$("${git[@]}" rev-parse --verify "$commit^{commit}")" || die "no commit $2 in $repo"
    cached="$CACHE_ROOT/tandem-images/$commit/$(echo "$tag" | tr '/:' '__').tar"
    [ -f "$cached" ] && { echo "$cached"; return 0; }
    src="$(mktemp -d)"
    "${git[@]}" archive "$commit" | tar -x -C "$src"
  else
    # What the image is built from, for its labels and `tandem-driver --version` (no .git in it).
    commit="$("${git[@]}" rev-parse HEAD 2>/dev/null)" || commit=""
  fi
  build_base_image
  mkdir -p "$out"
  # The build's RUN steps fetch the locked wheels from PyPI: they trust this machine's CA bundle
  # (which may hold a proxy's CA), mounted for the build only, so nothing of it lands in the image.
  "${PODMAN[@]}" build -q --network host --volume /etc/ssl/certs:/etc/ssl/certs:ro -t "$tag" \
    --build-arg TANDEM_COMMIT="$commit" --build-arg TANDEM_CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$src" \
    >"$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log" >&2; die "podman build failed"; }
  [ "$src" = "$repo" ] || rm -rf "$src"
  rm -f "$out/tandem.tar" # podman does not overwrite an archive
  "${PODMAN[@]}" save -q -o "$out/tandem.tar" "$tag" >/dev/null
  if [ -n "$cached" ]; then
    mkdir -p "$(dirname "$cached")"
    mv "$out/tandem.tar" "$cached"
    echo "$cached"
  else
    echo "$out/tandem.tar"
  fi
}
