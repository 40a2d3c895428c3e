# Starting each component of the cluster; sourced by lib.sh. Their flags are in components.conf
# (command_line, settings.sh), whose comments and docs/cluster.md say why each setting that is not
# a default is there.
# shellcheck shell=bash

: "${repo:?}" "${here:?}"

host_prereqs() {
  local need=()
  command -v openssl >/dev/null || need+=(openssl)
  [ -x /usr/sbin/runc ] || need+=(runc) # podman's, for `image`; containerd runs the runc of go.mod
  [ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
  command -v iptables >/dev/null || need+=(iptables)
  command -v conntrack >/dev/null || need+=(conntrack)
  command -v ip >/dev/null || need+=(iproute2)
  [ -x /bin/busybox ] || need+=(busybox-static)
  if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]} from Debian"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

# The node's address: the one on the interface of the default route. The API server advertises it
# (Endpoints may not name a loopback address) and the kubelet reports it.
detect_host_ip() {
  if [ -f "$STATE/host-ip" ]; then
    HOST_IP="$(cat "$STATE/host-ip")"
    return
  fi
  local dev
  dev="$(ip -4 route show default | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')"
  [ -n "$dev" ] || die "no default route: the cluster needs one interface address for its node"
  HOST_IP="$(ip -4 -o addr show dev "$dev" | awk '{split($4, a, "/"); print a[1]; exit}')"
  [ -n "$HOST_IP" ] || die "no IPv4 address on $dev"
  mkdir -p "$STATE"
  echo "$HOST_IP" >"$STATE/host-ip"
}

# Mount propagation: the driver pod mounts /dev and the driver root with HostToContainer, which
# needs the host's mounts to be shared. systemd makes every mount shared at boot; this machine
# runs without systemd, so do what it does (kind's node image does the same).
host_mounts_shared() {
  findmnt -no PROPAGATION / | grep -q shared || mount --make-rshared /
}

host_network_up() {
  detect_host_ip
  sysctl -qw net.ipv4.ip_forward=1
  # Pod-to-Service traffic crosses the CNI bridge; iptables must see it for kube-proxy's rules.
  [ -e /proc/sys/net/bridge ] || ip link add tandem-brnf type bridge 2>/dev/null || true
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  ip link del tandem-brnf 2>/dev/null || true
  # Service addresses are only ever rewritten by kube-proxy on this machine. Until its rules are in
  # place (and for any address it does not serve) they must not follow the default route off the
  # machine: route the whole range into a bridge without ports, which drops everything (this
  # kernel has no dummy interfaces).
  if ! ip link show tandem-svc >/dev/null 2>&1; then
    ip link add tandem-svc type bridge
    ip link set tandem-svc up
  fi
  ip route replace "$SERVICE_CIDR" dev tandem-svc
}

host_network_down() {
  ip link del tandem-svc 2>/dev/null || true
  ip link del "$NODES_BRIDGE" 2>/dev/null || true # the nodes' veths went with their namespaces
  ip link del tandem-cni0 2>/dev/null || true
  [ -x "${BIN:-}/kube-proxy" ] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  # What is left is the kubelet's (KUBE-FIREWALL, canaries): the jumps into it, then its chains.
  local ipt table rule chain
  for ipt in iptables ip6tables; do
    command -v "$ipt" >/dev/null || continue
    for table in filter nat mangle; do
      "$ipt" -t "$table" -S 2>/dev/null | grep -E '^-A [A-Z]+ .*-j KUBE-' | grep -vE '^-A KUBE-' |
        while read -r rule; do eval "$ipt -t $table ${rule/#-A/-D}" 2>/dev/null || true; done || true
      for chain in $("$ipt" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "$ipt" -t "$table" -F "$chain" 2>/dev/null || true
      done
      for chain in $("$ipt" -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
        "$ipt" -t "$table" -X "$chain" 2>/dev/null || true
      done
    done
  done
}

start_etcd() {
  mkdir -p "$STATE/etcd"
  chmod 700 "$STATE/etcd"
  command_line etcd
  start etcd "${CMD[@]}"
  wait_for 60 etcd "$LOGS/etcd.log" curl -sf "http://127.0.0.1:$ETCD_METRICS_PORT/health"
}

start_apiserver() {
  command_line kube-apiserver
  start kube-apiserver "${CMD[@]}"
  wait_for 120 kube-apiserver "$LOGS/kube-apiserver.log" kubectl_admin get --raw /readyz
}

# The API server calls the kubelet (logs, exec, metrics) as kube-apiserver-kubelet-client, which
# the kubelet's webhook authorization checks: grant it the kubelet API, as kubeadm does.
bootstrap_rbac() {
  kubectl_admin get clusterrolebinding tandem-cluster:apiserver-kubelet >/dev/null 2>&1 ||
    kubectl_admin create clusterrolebinding tandem-cluster:apiserver-kubelet \
      --clusterrole system:kubelet-api-admin --user kube-apiserver-kubelet-client >/dev/null
}

start_controller_manager() {
  command_line kube-controller-manager
  start kube-controller-manager "${CMD[@]}"
}

start_scheduler() {
  command_line kube-scheduler
  start kube-scheduler "${CMD[@]}"
}

start_containerd() {
  mkdir -p "$STATE/containerd" "$RUN/containerd" "$STATE/cni/net.d" "$CDI_ROOT"
  sed -e "s|@STATE@|$STATE|g" -e "s|@RUN@|$RUN|g" -e "s|@CDI_ROOT@|$CDI_ROOT|g" -e "s|@BIN@|$BIN|g" \
    -e "s|@PAUSE_IMAGE@|$PAUSE_IMAGE|g" "$here/config/containerd.toml" >"$STATE/containerd/config.toml"
  sed -e "s|@POD_CIDR@|$POD_CIDR|g" "$here/config/cni.conflist" >"$STATE/cni/net.d/10-tandem.conflist"
  command_line containerd
  # The shim finds runc and itself on PATH.
  PATH="$BIN:$PATH" start containerd "${CMD[@]}"
  wait_for 60 containerd "$LOGS/containerd.log" "$BIN/ctr" --address "$CONTAINERD_SOCK" version
}

import_images() {
  local images="$BIN/../images" tar
  for tar in "$images"/pause.tar "$images"/busybox.tar "$@"; do
    "$BIN/ctr" --address "$CONTAINERD_SOCK" -n k8s.io images import --no-unpack=false "$tar" >/dev/null
  done
}

start_kubelet() {
  mkdir -p "$STATE/kubelet" "$KUBELET_ROOT"
  sed -e "s|@PKI@|$NODE_PKI|g" -e "s|@CONTAINERD_SOCK@|$CONTAINERD_SOCK|g" -e "s|@CGROUP_ROOT@|$CGROUP_ROOT|g" \
    -e "s|@FEATURE_GATES@|$(echo "$FEATURE_GATES" | sed 's/=/: /g; s/,/, /g')|" \
    "$here/config/kubelet.yaml" >"$STATE/kubelet/config.yaml"
  command_line kubelet
  start kubelet "${CMD[@]}"
  wait_for 120 "node $NODE_NAME Ready" "$LOGS/kubelet.log" \
    kubectl_admin wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
}

start_kube_proxy() {
  command_line kube-proxy
  start kube-proxy "${CMD[@]}"
  wait_for 60 kube-proxy "$LOGS/kube-proxy.log" "${IN_NODE[@]}" curl -sf http://127.0.0.1:10256/healthz
}

remove_all_containers() {
  [ -S "$CONTAINERD_SOCK" ] || return 0
  local ctr=("$BIN/ctr" --address "$CONTAINERD_SOCK" -n k8s.io) id
  for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
  done
  for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks delete -f "$id" >/dev/null 2>&1 || true
  done
  for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
    "${ctr[@]}" containers delete "$id" >/dev/null 2>&1 || true
  done
}

# Everything of daemonset.yaml but the DaemonSet: namespace, RBAC, the admission policy and the
# DeviceClasses. The DaemonSet itself is what the e2e suite deploys (tests/cluster).
# The chart's objects but the DaemonSet (Tandem runs as a node process here), rendered as
# daemonset.yaml is but with the RBAC of binding conditions: the cluster tests restart Tandem with
# --dynamic-mig and --nic-binding-conditions, whose pod watch the default render does not grant.
install_tandem_objects() {
  local helm
  helm="$("$repo/hack/helm.sh")"
  "$helm" template tandem "$repo/deployments/helm/tandem" --namespace tandem-system --kube-version 1.37.0 \
    --set nics.bindingConditions=true |
    "$repo/.venv/bin/python" -c '
import sys, yaml
docs = [d for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] != "DaemonSet"]
print(yaml.safe_dump_all(docs))
' | kubectl_admin apply -f - >/dev/null
}

# The simulated NICs' netdevs (veths named and addressed as the NICs), and the kernel's part when a
# pod's namespace that holds one goes (demo/cluster_nics.py): exclusive NICs move for real.
start_nic_hardware() {
  start nic-hardware env PYTHONPATH="$repo" "$repo/.venv/bin/python" -m demo.cluster_nics run \
    --root "$STATE/node" --node-name "$NODE_NAME" --gpus "$NODE_GPUS" --nics "$NODE_NICS"
  wait_for 60 "the NICs' netdevs" "$LOGS/nic-hardware.log" nics_present
}

nics_present() {
  [ "$("${IN_NODE[@]}" ip -br link show | grep -cE '^ens[0-9]+f0np0[@ ]')" -gt 0 ]
}

stop_nic_hardware() {
  stop nic-hardware
  [ -d "$STATE/node" ] || return 0
  (cd "$repo" && "${IN_NODE[@]}" .venv/bin/python -m demo.cluster_nics down --root "$STATE/node" \
    --node-name "$NODE_NAME" --gpus "$NODE_GPUS" --nics "$NODE_NICS") || true
}

# Tandem as a process on the node, with the service account of daemonset.yaml: a token bound to
# this node, so that the RBAC rules and the admission policy apply to it as to the driver's pod.
start_tandem_node() {
  local dir="$STATE/tandem" token
  mkdir -p "$dir"
  token="$(kubectl_admin -n tandem-system create token tandem-driver --bound-object-kind Node \
    --bound-object-name "$NODE_NAME" --duration 24h)"
  cat >"$dir/kubeconfig" <<EOF2
apiVersion: v1
kind: Config
clusters:
  - name: tandem
    cluster: {server: "$API_SERVER", certificate-authority: "$NODE_PKI/ca.crt"}
users:
  - name: tandem-driver
    user: {token: "$token"}
contexts:
  - name: tandem
    context: {cluster: tandem, user: tandem-driver}
current-context: tandem
EOF2
  chmod 600 "$dir/kubeconfig"
  (cd "$repo" && "${IN_NODE[@]}" .venv/bin/python -m demo.cluster_node start --root "$STATE/node" \
    --kubeconfig "$dir/kubeconfig" --node-name "$NODE_NAME" --gpus "$NODE_GPUS" --nics "$NODE_NICS" \
    -- --log-format json) >/dev/null
  ln -sf "$STATE/node/tandem.pid" "$RUN/tandem.pid"
  ln -sf "$STATE/node/tandem.log" "$LOGS/tandem.log"
  wait_for 60 "Tandem's ResourceSlices" "$LOGS/tandem.log" tandem_published
}

tandem_published() {
  [ "$(kubectl_admin get resourceslices --field-selector "spec.nodeName=$NODE_NAME,spec.driver=tandem.dev" \
    -o name | wc -l)" -gt 0 ]
}
