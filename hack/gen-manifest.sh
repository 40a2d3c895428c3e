#!/usr/bin/env bash
# Regenerates daemonset.yaml, the plain-manifest install, from the Helm chart with its default
# values: the chart is the one source of truth, and tests/integration/test_helm_chart.py fails while
# the two disagree. `hack/gen-manifest.sh -` prints the render instead of writing it (the test's
# way). Needs Go the first time, to build helm (hack/helm.sh).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
helm="$("$repo/hack/helm.sh")"

render() {
  cat <<'EOF'
# GENERATED from the Helm chart deployments/helm/tandem with its default values by
# hack/gen-manifest.sh; do not edit. Change the chart (its templates and values.yaml) and run
# hack/gen-manifest.sh. Each object's `# Source:` line names the template it comes from.
#
# Tandem: DRA driver for NVIDIA GPUs and RDMA (RoCE) NICs, for Kubernetes 1.37.
#
# One file installs everything:   kubectl apply -f daemonset.yaml
# Remove it again:                 kubectl delete -f daemonset.yaml
#   (ResourceSlices stay behind on purpose when the driver stops; after an uninstall delete them with
#    kubectl delete resourceslices --field-selector spec.driver=tandem.dev)
# The same with Helm, and every setting: docs/deployment.md.
#
# Contents, in apply order: Namespace, ResourceQuota (critical-pod admission), ServiceAccount,
# ClusterRole + ClusterRoleBinding, DaemonSet, DeviceClasses (gpu, mig, nic),
# ValidatingAdmissionPolicies + Bindings (claims' GpuConfig/NicConfig; own node's, own driver's
# slices only; the driver's Events only about its claims and its own Node). Scenario examples live
# in examples/, docs in docs/.
#
# The driver name `tandem.dev` (the chart's driverName) appears in six places that must agree:
# DRIVER_NAME in the DaemonSet, the data directory /var/lib/kubelet/plugins/tandem.dev, the
# resourceNames of the `resourceclaims/driver` rule, the ValidatingAdmissionPolicy's spec.driver,
# the opaque driver of the claims the tandem-opaque-config policy checks, and every DeviceClass
# selector. tests/unit/test_manifests.py checks it.
EOF
  # The chart needs Kubernetes 1.37 (its kubeVersion); helm's built-in default is older.
  "$helm" template tandem "$repo/deployments/helm/tandem" --namespace tandem-system --kube-version 1.37.0
}

if [ "${1:-}" = - ]; then
  render
else
  # Through a file of its own: a failed render leaves daemonset.yaml as it was.
  render >"$repo/daemonset.yaml.new"
  mv "$repo/daemonset.yaml.new" "$repo/daemonset.yaml"
  echo "wrote $repo/daemonset.yaml" >&2
fi
