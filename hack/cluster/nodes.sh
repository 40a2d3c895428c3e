# The cluster's nodes (`hack/cluster.sh up --nodes N`); sourced by lib.sh. docs/cluster.md, 'More
# than one node', says why they are made this way.
#
# Node 1 ($NODE_NAME) is the machine itself, exactly as in a one-node cluster. Node I >= 2
# ($NODE_NAME-I) lives in a network and a mount namespace of its own, which a `pause` process holds
# open; its containerd, kubelet, kube-proxy, NIC hardware and Tandem all run in both. In its mount
# namespace the standard node directories (/var/lib/kubelet, /var/run/cdi, ...) are bind mounts of
# its own directories under $STATE/nodes/<name>/root, so each kubelet, plugin registry, CDI
# directory and Tandem data directory is its node's alone, at the path daemonset.yaml mounts; and
# its simulated hardware is also at node 1's path, so a DaemonSet finds each node's own there. Its
# network namespace has its own address on the bridge tandem-nodes, its own pod bridge and range,
# iptables and NIC netdevs (the same names on every node, as on real ones). Every node has its own
# kubelet credentials (system:node:<name>) and Tandem its own token bound to its own Node.
# shellcheck shell=bash

: "${repo:?}" "${here:?}"

NODES_BRIDGE=tandem-nodes
# Node 1's simulated hardware. In node I's mount namespace this path is its own (node_namespaces_up),
# so one DaemonSet's pod template finds each node's hardware at the same path.
HARDWARE_PATH="$STATE/node"
NODES_GATEWAY=10.250.0.1 # the machine's end of the bridge, in 10.250.0.0/24; node I is 10.250.0.(10+I)

# use_node I: the settings of node I (none change for node 1). Run it in a subshell: it points
# STATE, RUN and LOGS at the node's own directory, so every component function works on the node.
# shellcheck disable=SC2034 # the variables it sets are the other files' (lib.sh)
use_node() {
  local i="$1"
  [ "$i" -gt 1 ] || return 0
  detect_host_ip
  API_SERVER="https://$HOST_IP:$APISERVER_PORT" # the node's loopback is its own; the machine's address is in the certificate
  NODE_NAME="$NODE_NAME-$i"
  STATE="$STATE/nodes/$NODE_NAME"
  RUN="$STATE/run"
  LOGS="$STATE/logs"
  CONTAINERD_SOCK="$RUN/containerd/containerd.sock"
  NODE_PKI="$PKI/nodes/$NODE_NAME"
  HOST_IP="${NODES_GATEWAY%.*}.$((10 + i))"
  POD_CIDR="10.245.$i.0/24"
  CGROUP_ROOT="/$NODE_NAME"
  # Nodes 1 and 2 are HGX boards; the third and later a smaller one, so a scheduler that chooses
  # between nodes has different shapes to choose from.
  if [ "$i" -ge 3 ]; then
    NODE_GPUS=4
    NODE_NICS=2
  fi
  if running namespaces; then
    IN_NODE=(nsenter --target "$(cat "$RUN/namespaces.pid")" --mount --net --wd="$repo" --)
  fi
}

# node_indexes: the numbers of the nodes beyond the first that `up` made.
node_indexes() {
  local dir
  for dir in "$STATE"/nodes/*/; do
    [ -d "$dir" ] || continue
    dir="${dir%/}"
    echo "${dir##*-}"
  done | sort -n
}

# The directories a node has for itself, at their standard paths. /run/nri: every containerd
# removes the NRI socket there and binds its own, so two nodes' containerds starting at once made
# one fail ("bind: address already in use").
node_dirs() {
  echo "$KUBELET_ROOT" "$CDI_ROOT" /var/lib/cni /run/netns /run/containerd /run/nri /var/log/pods /var/log/containers
}

# node_pki: node I's credentials (the node's settings in force). One node at a time: the CA's
# serial file is one for all.
node_pki() {
  mkdir -p "$NODE_PKI"
  cp "$PKI/ca.crt" "$NODE_PKI/ca.crt" # a node holds the CA's certificate, never its key
  node_certs "nodes/$NODE_NAME/"
}

# node_namespaces_up: node I's cgroup and namespaces (the node's settings in force).
node_namespaces_up() {
  mkdir -p "$STATE"
  node_cgroup_up
  running namespaces && return 0
  start namespaces unshare --mount --net --propagation slave -- "$BIN/pause"
  wait_for 30 "node $NODE_NAME's namespaces" "$LOGS/namespaces.log" node_namespaces_entered
  IN_NODE=(nsenter --target "$(cat "$RUN/namespaces.pid")" --mount --net --wd="$repo" --)
  local dir
  for dir in $(node_dirs); do
    dir="$(readlink -f "$dir")" # /var/run is a link to /run
    mkdir -p "$dir" "$STATE/root$dir"
    "${IN_NODE[@]}" mount --bind "$STATE/root$dir" "$dir"
  done
  # The node's hardware at node 1's path too. Nothing on the node names that path but a pod (the
  # node's own processes use $STATE/node); neither directory is ever removed while the node lives.
  mkdir -p "$HARDWARE_PATH" "$STATE/node"
  "${IN_NODE[@]}" mount --bind "$STATE/node" "$HARDWARE_PATH"
  # As on the machine (host_mounts_shared): pods mount with HostToContainer propagation.
  "${IN_NODE[@]}" mount --make-rshared /
  node_network_up
}

node_namespaces_entered() {
  [ "$(cat "/proc/$(cat "$RUN/namespaces.pid")/comm")" = pause ] # unshare has made them and exec'd
}

# The node's link to the machine: a veth from its namespace into the bridge, the node's address on
# it, a default route through the machine, and the machine's route to the node's pods.
node_network_up() {
  local host_end="tandem-n${NODE_NAME##*-}"
  ip link add "$host_end" type veth peer name eth0 netns "$(cat "$RUN/namespaces.pid")"
  ip link set "$host_end" master "$NODES_BRIDGE" up
  "${IN_NODE[@]}" ip link set lo up
  "${IN_NODE[@]}" ip address add "$HOST_IP/24" dev eth0
  "${IN_NODE[@]}" ip link set eth0 up
  "${IN_NODE[@]}" ip route add default via "$NODES_GATEWAY"
  # Forwarding and bridge netfilter are per namespace: the node's pods and kube-proxy need both.
  "${IN_NODE[@]}" sysctl -qw net.ipv4.ip_forward=1
  "${IN_NODE[@]}" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  ip route replace "$POD_CIDR" via "$HOST_IP"
}

# The nodes' network: a bridge on the machine (hack/cluster.sh down removes it, host_network_down).
nodes_bridge_up() {
  ip link show "$NODES_BRIDGE" >/dev/null 2>&1 && return 0
  ip link add "$NODES_BRIDGE" type bridge
  ip address add "$NODES_GATEWAY/24" dev "$NODES_BRIDGE"
  ip link set "$NODES_BRIDGE" up
}

# The kubelet's cgroupRoot must exist in every hierarchy; a new cpuset has no CPUs or memory nodes
# until it is given its parent's.
node_cgroup_up() {
  local h
  for h in /sys/fs/cgroup/*/; do
    [ -f "${h}cgroup.procs" ] && mkdir -p "$h$NODE_NAME"
  done
  if [ -f /sys/fs/cgroup/cpuset/cpuset.cpus ]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$NODE_NAME/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$NODE_NAME/cpuset.mems"
  fi
}

# node_namespaces_down: once its processes are gone, the namespaces go, and with them the node's
# mounts, netdevs and iptables; then its cgroup. The veth first: the kernel destroys what a network
# namespace held some time after the namespace goes, and a quick `up` would find it still there.
node_namespaces_down() {
  ip link del "tandem-n${NODE_NAME##*-}" 2>/dev/null || true
  stop namespaces
  local h
  for h in /sys/fs/cgroup/*/"$NODE_NAME"; do
    [ ! -d "$h" ] || find "$h" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

# start_node: the node's components in its namespaces: the container runtime with the local
# images, the kubelet, kube-proxy, the simulated NICs' netdevs and Tandem.
start_node() {
  start_containerd
  import_images
  start_kubelet
  start_kube_proxy
  start_nic_hardware
  if [ "${TANDEM_CLUSTER_TANDEM:-node}" = node ]; then
    start_tandem_node
  fi
}

# stop_node: Tandem and the kubelet first, so nothing restarts what is being torn down; then every
# pod's containers through containerd (their processes belong to shims that outlive containerd).
stop_node() {
  stop tandem
  stop kube-proxy
  stop kubelet
  remove_all_containers
  stop_nic_hardware
  stop containerd
  # A shim whose container could not be killed through containerd would hold mounts.
  pkill -KILL -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null || true
}
