# Shared by hack/cluster.sh and hack/e2e.sh: paths, process control, waiting, and the commands.
# shellcheck shell=bash

: "${repo:?}" "${here:?}"
# shellcheck source=settings.sh
source "$here/settings.sh"
load_settings
STATE="${TANDEM_CLUSTER_STATE:-/var/lib/tandem-cluster}"
RUN="$STATE/run"
LOGS="$STATE/logs"
PKI="$STATE/pki"
CACHE_ROOT="${TANDEM_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem-cluster}"
NODE_NAME="${TANDEM_CLUSTER_NODE:-tandem-node}"
# The kubelet's and Tandem's default directories: the DaemonSet mounts exactly these host paths.
KUBELET_ROOT=/var/lib/kubelet
CDI_ROOT=/var/run/cdi
# Pods get addresses from this range on a bridge of their own; Services from the next one. Neither
# range is routed off this machine: see host_network_up.
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
API_SERVICE_IP=10.96.0.1
CONTAINERD_SOCK="$RUN/containerd/containerd.sock"
TEST_IMAGE=localhost/tandem/busybox:1
PAUSE_IMAGE=localhost/tandem/pause:1
ADMIN_KUBECONFIG="$PKI/admin.kubeconfig"
API_SERVER="https://127.0.0.1:$APISERVER_PORT"
# What differs between the nodes of `up --nodes N` (nodes.sh, use_node): node 1, the only one of a
# one-node cluster, runs in the machine's own namespaces with these; nodes 2..N each in their own.
NODE_PKI="$PKI"    # the node's credentials and its copy of the CA certificate
CGROUP_ROOT=/      # the kubelet's cgroupRoot
NODE_GPUS=8        # the simulated node's size (demo/cluster_node.py)
NODE_NICS=4
IN_NODE=()         # the command prefix that runs a command in the node's namespaces

# shellcheck source=build.sh
source "$here/build.sh"
# shellcheck source=pki.sh
source "$here/pki.sh"
# shellcheck source=components.sh
source "$here/components.sh"
# shellcheck source=nodes.sh
source "$here/nodes.sh"

say() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "the cluster needs root (it runs a kubelet, a container runtime and iptables)"
}

# wait_for SECONDS DESCRIPTION LOGFILE COMMAND...: poll COMMAND until it succeeds; on timeout,
# show the end of the component's log so the failure explains itself.
wait_for() {
  local timeout="$1" what="$2" logfile="$3"
  shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "timed out after ${timeout}s waiting for $what"
      [ -n "$logfile" ] && [ -f "$logfile" ] && tail -n 40 "$logfile" >&2
      return 1
    fi
    sleep 0.5
  done
}

# start NAME COMMAND...: run COMMAND in a session of its own (it outlives this script), logging to
# $LOGS/NAME.log, unless the pid in $RUN/NAME.pid still runs it. The component keeps none of this
# script's other descriptors: a lock held around `hack/cluster.sh up` (flock) must end with it,
# not live on in etcd or the kubelet.
start() {
  local name="$1"
  shift
  if running "$name"; then
    return 0
  fi
  mkdir -p "$LOGS" "$RUN"
  (
    for fd in /proc/self/fd/*; do
      fd="${fd##*/}"
      [ "$fd" -gt 2 ] && eval "exec $fd>&-" 2>/dev/null
    done
    exec setsid "${IN_NODE[@]}" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null
  ) &
  echo $! >"$RUN/$name.pid"
}

running() {
  local pid
  pid="$(cat "$RUN/$1.pid" 2>/dev/null)" || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

stop() {
  local name="$1" pid
  pid="$(cat "$RUN/$name.pid" 2>/dev/null)" || return 0
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$RUN/$name.pid"
}

kubectl_admin() { "$BIN/kubectl" --kubeconfig "$ADMIN_KUBECONFIG" "$@"; }

cluster_env() {
  find_build || die "the cluster is not built yet: run hack/cluster.sh up"
  echo "export KUBECONFIG=$ADMIN_KUBECONFIG"
  echo "export PATH=$BIN:\$PATH"
  echo "export TANDEM_TEST_IMAGE=$TEST_IMAGE"
}

cluster_build() {
  need_root
  host_prereqs
  build_binaries
  build_images
}

cluster_up() {
  need_root
  local t0=$SECONDS nodes=1 i pids=() pid
  while [ $# -gt 0 ]; do
    case "$1" in
      --nodes) nodes="${2:-}"; shift 2 || shift ;;
      *) die "up: unknown option $1" ;;
    esac
  done
  [[ "$nodes" =~ ^[1-9][0-9]?$ ]] || die "up: --nodes wants a number of nodes from 1 to 99"
  host_prereqs # first: building the images needs Debian's busybox-static on a fresh machine
  # Tandem's node process, the NIC hardware and the rendering of daemonset.yaml's objects run on
  # .venv's Python, which on a fresh checkout nothing has made yet (hack/test.sh, hack/demo.sh and
  # hack/e2e.sh make it too; a second run only checks it).
  TANDEM_EXTRAS="test" "$repo/hack/venv.sh"
  build_binaries
  build_images
  host_mounts_shared
  host_network_up
  control_plane_up
  [ "$nodes" = 1 ] || nodes_bridge_up
  for ((i = 2; i <= nodes; i++)); do
    (use_node "$i"; node_pki)
  done
  # The nodes side by side: most of a node's start is waiting for its kubelet and its Tandem.
  start_node &
  pids+=($!)
  for ((i = 2; i <= nodes; i++)); do
    (use_node "$i"; node_namespaces_up; start_node) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || die "a node did not come up: its component's log is above, the others in hack/cluster.sh status"
  done
  say "cluster up in $((SECONDS - t0))s"
  cluster_status
  cat >&2 <<EOF

Use it:  eval "\$($repo/hack/cluster.sh env)"; kubectl get resourceslices
Stop it: $repo/hack/cluster.sh down
EOF
}

# control_plane_up: certificates, etcd, the API server, the controller manager, the scheduler, and
# everything of daemonset.yaml but the DaemonSet: what `up` starts before the nodes, and all that
# the scale bench (hack/scale/) runs of the cluster. It touches nothing of the machine but its state
# directory and its ports, so it needs no root.
control_plane_up() {
  build_binaries
  detect_host_ip
  make_pki
  start_etcd
  start_apiserver
  bootstrap_rbac
  start_controller_manager
  start_scheduler
  install_tandem_objects
}

control_plane_down() {
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
}

# cluster_restart COMPONENT [NODE]: NODE for the components of a node other than the first.
cluster_restart() {
  need_root
  find_build || die "the cluster is not built yet: run hack/cluster.sh up"
  detect_host_ip
  local name="$1" node="${2:-$NODE_NAME}" starter
  if [ "$node" != "$NODE_NAME" ]; then
    [ -d "$STATE/nodes/$node" ] || die "the cluster has no node $node"
    use_node "${node##*-}"
  fi
  case "$name" in
    etcd | containerd | kubelet | kube-proxy) starter="start_${name//-/_}" ;;
    kube-scheduler) starter=start_scheduler ;;
    kube-apiserver) starter=start_apiserver ;;
    kube-controller-manager) starter=start_controller_manager ;;
    tandem) starter=start_tandem_node ;;
    nic-hardware) starter=start_nic_hardware ;;
    *) die "unknown component $name" ;;
  esac
  if [ "$name" = tandem ]; then
    (cd "$repo" && .venv/bin/python -m demo.cluster_node stop --root "$STATE/node")
  else
    stop "$name"
  fi
  "$starter"
}

# cluster_etcd_save / cluster_etcd_restore: a copy of etcd's data directory, and etcd put back to
# it as a restore from a backup is done (what Tandem must catch up with: tests/cluster/
# test_etcd_restore.py). etcd is stopped for the copy, so that its database and WAL are of one
# moment; the API server rides that out. For the restore the API server is stopped first and started
# again on the restored data, as upstream's runbook says: its watch cache would go on serving what
# etcd no longer has; the controllers, the scheduler, kube-proxy and the kubelet are restarted too. The restored etcd keeps the copy's objects with their resourceVersions and
# numbers on from the copy's revision.
cluster_etcd_save() {
  need_root
  find_build || die "the cluster is not built yet: run hack/cluster.sh up"
  detect_host_ip
  running etcd || die "etcd is not running: hack/cluster.sh up"
  stop etcd
  rm -rf "$STATE/etcd-backup"
  cp -a "$STATE/etcd" "$STATE/etcd-backup"
  start_etcd
  say "etcd's data saved in $STATE/etcd-backup"
}

cluster_etcd_restore() {
  need_root
  find_build || die "the cluster is not built yet: run hack/cluster.sh up"
  detect_host_ip
  [ -d "$STATE/etcd-backup" ] || die "no etcd backup: hack/cluster.sh etcd-save first"
  stop kube-apiserver
  stop etcd
  rm -rf "$STATE/etcd-restoring"
  cp -a "$STATE/etcd-backup" "$STATE/etcd-restoring"
  rm -rf "$STATE/etcd"
  mv "$STATE/etcd-restoring" "$STATE/etcd"
  start_etcd
  start_apiserver
  # Then every component that watches the API server, as the runbook recommends: their informers
  # hold resourceVersions the restored server never had, and their watches would stay stuck on
  # them (no service accounts made, no DaemonSet pods, no evictions). Tandem is left running: its
  # catching up on its own is what the restore tests.
  local component
  for component in kube-controller-manager kube-scheduler kube-proxy kubelet; do
    cluster_restart "$component"
  done
  say "etcd restored from $STATE/etcd-backup; the API server and every component watching it started again"
}

# cluster_image TAG [COMMIT]: the project's image (of COMMIT: build_tandem_image), as the
# DaemonSet would pull it, in every node's containerd.
cluster_image() {
  need_root
  find_build || die "the cluster is not built yet: run hack/cluster.sh up"
  local archive i
  archive="$(build_tandem_image "$1" "${2:-}")" # a failed build stops here (set -e), not in the import
  import_images "$archive"
  for i in $(node_indexes); do
    (use_node "$i"; import_images "$archive")
  done
  echo "$1"
}

cluster_status() {
  local i
  printf '%-20s %-8s %s\n' COMPONENT STATE LOG >&2
  components_status "" etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy \
    nic-hardware tandem
  for i in $(node_indexes); do
    (use_node "$i"; components_status "$NODE_NAME/" namespaces containerd kubelet kube-proxy nic-hardware tandem)
  done
}

# components_status PREFIX NAME...: a line for each component that ran, its name after PREFIX.
components_status() {
  local prefix="$1" name
  shift
  for name in "$@"; do
    if running "$name"; then
      printf '%-20s %-8s %s\n' "$prefix$name" running "$LOGS/$name.log" >&2
    elif [ -f "$LOGS/$name.log" ]; then
      printf '%-20s %-8s %s\n' "$prefix$name" stopped "$LOGS/$name.log" >&2
    fi
  done
}

cluster_down() {
  need_root
  find_build || true
  local i
  # The nodes first, side by side, then the control plane.
  for i in $(node_indexes); do
    (use_node "$i"; stop_node; node_namespaces_down) &
  done
  stop_node
  wait
  control_plane_down
  host_network_down
  unmount_below "$KUBELET_ROOT"
  unmount_below "$STATE"
  local netns
  for netns in /run/netns/cni-*; do # the pods' network namespaces (containerd names them cni-*)
    [ -e "$netns" ] || continue
    umount -l "$netns" 2>/dev/null || true
    rm -f "$netns"
  done
  rm -rf --one-file-system "$KUBELET_ROOT" "$STATE"
  rm -f "$CDI_ROOT"/k8s.tandem.dev-*.json "$CDI_ROOT"/*tandem.dev*metadata*.json 2>/dev/null || true
  local cgroups
  cgroups="$(compgen -G "/sys/fs/cgroup/*/$NODE_NAME-[0-9]*" || true)"
  if pgrep -f "$STATE|$CONTAINERD_SOCK" >/dev/null || [ -e "$STATE" ] || [ -e "$KUBELET_ROOT" ] || [ -n "$cgroups" ]; then
    die "something of the cluster is left: $(pgrep -af "$STATE|$CONTAINERD_SOCK" | head -3) $cgroups"
  fi
  say "cluster removed"
}

# unmount_below DIR: every mount point at or below DIR, deepest first; rm -rf must never follow a
# bind mount into the host's own files.
unmount_below() {
  local dir="$1" m
  [ -d "$dir" ] || return 0
  dir="$(readlink -f "$dir")"
  awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  if awk -v d="$dir" '$5 == d || index($5, d "/") == 1' /proc/self/mountinfo | grep -q .; then
    die "could not unmount everything below $dir; not removing it"
  fi
}
