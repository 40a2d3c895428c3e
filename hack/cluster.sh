#!/usr/bin/env bash
# A real Kubernetes v1.37 cluster on this machine (one node, or more), with Tandem serving devices.
#
#   hack/cluster.sh up [--nodes N]   build (first time, cached), start everything, start Tandem on
#                           each node; idempotent. N nodes (default 1): docs/cluster.md
#   hack/cluster.sh env     export lines for a shell: eval "$(hack/cluster.sh env)"
#   hack/cluster.sh status  what runs, and where each component logs
#   hack/cluster.sh down    stop everything and remove the cluster's state
#   hack/cluster.sh restart COMPONENT [NODE]   e.g. kubelet, containerd, kube-apiserver, tandem
#   hack/cluster.sh etcd-save|etcd-restore   copy etcd's data aside; put it back (API server restarted)
#   hack/cluster.sh image [TAG [COMMIT]]  build the Dockerfile's image (of COMMIT: cached), load it
#                           into every node
#   hack/cluster.sh build   only build (or find cached) binaries and images
#   hack/cluster.sh control-plane up|down   the control plane alone (no node, no root): the
#                           scale bench's, in a state directory and on ports of its own
#
# Upstream parts, versions pinned in hack/cluster/go.mod: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl, containerd and runc, built
# from their Go modules (runc with cgo and libseccomp, hack/cluster/build.sh: exclusive NICs need
# the runtime-spec 1.3 `linux.netDevices` that Debian 12's runc 1.1.5 lacks); the CNI plugins from
# Debian (Debian's runc is installed too, for podman in `image` only). Set up as a production
# cluster: TLS everywhere, Node+RBAC authorization, NodeRestriction, bound service-account tokens,
# the kubelet with its own node identity. docs/cluster.md explains every setting that differs from
# a default and why (cgroup v1 on this machine, no registry, nodes in namespaces of their own).
#
# Every component's flags, the feature gates and the ports are in hack/cluster/components.conf.
# Environment: TANDEM_CLUSTER_STATE (default /var/lib/tandem-cluster), TANDEM_CLUSTER_CACHE
# (default ~/.cache/tandem-cluster), TANDEM_CLUSTER_TANDEM=none to start no Tandem node process,
# TANDEM_CLUSTER_PROFILE=scale for the scale bench's ports and flags (components.conf).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
here="$repo/hack/cluster"
# shellcheck source=cluster/lib.sh
source "$here/lib.sh"

case "${1:-}" in
  up) cluster_up "${@:2}" ;;
  down) cluster_down ;;
  env) cluster_env ;;
  status) cluster_status ;;
  build) cluster_build ;;
  control-plane)
    case "${2:-}" in
      up) control_plane_up ;;
      down) control_plane_down ;;
      *) echo "usage: hack/cluster.sh control-plane up|down" >&2; exit 2 ;;
    esac
    ;;
  restart) cluster_restart "${2:?which component?}" "${@:3}" ;;
  etcd-save) cluster_etcd_save ;;
  etcd-restore) cluster_etcd_restore ;;
  image) cluster_image "${2:-localhost/tandem-driver:dev}" "${3:-}" ;;
  *)
    sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
