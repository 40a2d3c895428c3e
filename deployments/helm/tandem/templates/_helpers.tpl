{{/*
The prefix of the chart's object names: the release name (tandem-driver, tandem-opaque-config, ...
for a release called tandem, which hack/gen-manifest.sh renders), so two releases never fight over
one cluster-wide object. The DeviceClasses are named after the driver instead (gpu.<driverName>).
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The driver's own objects: ServiceAccount, ClusterRole(+Binding) and DaemonSet. */}}
{{- define "tandem.name" -}}
{{- include "tandem.fullname" . }}-driver
{{- end -}}

{{/*
The labels every object of the chart carries (helm create's and Bitnami's set). The name is the
chart's own, never nameOverride (which names objects only): selectors written with it, the
DaemonSet's immutable one among them, must not move with a value.
*/}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/*
What tells this release's objects from another's: a selector built from these (the metrics
Service's and the ServiceMonitor's, with a component) picks this release's pods only, even beside
another release in the same namespace.
*/}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The DaemonSet's spec.selector: 0.1.0's plain manifest's, to the letter, without the release.
Kubernetes refuses any change to a DaemonSet's selector ("field is immutable"), so a selector with
app.kubernetes.io/instance would fail both `helm upgrade --take-ownership` from 0.1.0's DaemonSet
and `kubectl replace` back to it (docs/deployment.md, 'Labels and selectors'). Two releases in one
namespace still keep to their own pods: the DaemonSet controller acts on the pods it owns
(ownerReferences), and everything else selects with tandem.selectorLabels. The pods carry both.
*/}}
{{- define "tandem.kubeletPluginSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{/*
The exec of the driver container's probes: a shell test of the probe file the daemon's main loop
rewrites every 10 s (`<valid until> <ready|unready|dead> <why>`, named by POD_UID); no Python
starts. The argument is what the verdict must be: "alive" (anything but dead: liveness, start-up)
or "ready" (readiness). The daemonset template says why each probe wants which.
*/}}
{{- define "tandem.probe" -}}
exec:
  command:
    - sh
    - -c
    - |
      f="$KUBELET_PLUGINS_DIRECTORY_PATH/$DRIVER_NAME/probe${POD_UID:+-$POD_UID}"
      read -r until verdict why < "$f" || exit 1
      [ "$(date +%s)" -le "$until" ] || { echo "$f: verdict expired at $until: the daemon stopped refreshing it"; exit 1; }
      {{- if eq . "ready" }}
      [ "$verdict" = ready ] || { echo "not ready: $why"; exit 1; }
      {{- else if eq . "alive" }}
      [ "$verdict" != dead ] || { echo "not alive: $why"; exit 1; }
      {{- else }}
      {{- fail (printf "tandem.probe: %q is neither \"alive\" nor \"ready\"" .) }}
      {{- end }}
{{- end -}}

{{- define "tandem.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* A value that is "all" or a list, as the daemon's flag takes it: all, or comma-separated. */}}
{{- define "tandem.gpuList" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ join "," . }}{{- end -}}
{{- end -}}

{{/*
Combinations the chart refuses to render, each with the reason, because they break a cluster or a
tenant's isolation rather than merely Tandem (docs/deployment.md, 'What the chart refuses').
*/}}
{{- define "tandem.validate" -}}
{{- $ns := .Release.Namespace -}}
{{- if has $ns (list "default" "kube-system" "kube-public" "kube-node-lease") -}}
{{- fail (printf "namespace %q: Tandem's namespace must admit privileged pods (Pod Security level `privileged`) and hold nothing else, and with createNamespace the chart labels it so; install into a namespace of its own: kubectl create namespace tandem-system, then helm install --namespace tandem-system --take-ownership" $ns) -}}
{{- end -}}
{{- $driver := .Values.driverName -}}
{{- if or (eq $driver "gpu.nvidia.com") (eq $driver "compute-domain.nvidia.com") (hasSuffix ".k8s.io" $driver) (eq $driver "k8s.io") -}}
{{- fail (printf "driverName %q belongs to another DRA driver: NVIDIA's GPU driver (which serves the same GPUs) or a Kubernetes-reserved domain; two drivers under one name overwrite each other's ResourceSlices and the admission policy would let Tandem write theirs. Keep tandem.dev or use a domain you own" $driver) -}}
{{- end -}}
{{- if and (not (has "gpu" .Values.deviceKinds)) (or .Values.gpuSharing .Values.dynamicMig.gpus) -}}
{{- fail "gpuSharing and dynamicMig.gpus need \"gpu\" in deviceKinds: a node that serves no GPUs cannot share or partition them" -}}
{{- end -}}
{{- if and (eq .Values.deviceClasses.gpu.extendedResourceName "nvidia.com/gpu") (not (has "gpu" .Values.deviceKinds)) .Values.deviceClasses.gpu.enabled -}}
{{- fail "deviceClasses.gpu.extendedResourceName nvidia.com/gpu with deviceKinds lacking \"gpu\": pods asking for nvidia.com/gpu would wait for GPUs Tandem never publishes; set it to \"\" or disable deviceClasses.gpu" -}}
{{- end -}}
{{- end -}}

{{/* The grey-failure thresholds map as GREY_THRESHOLDS wants it: NAME=VALUE,... in name order. */}}
{{- define "tandem.greyThresholds" -}}
{{- $pairs := list -}}
{{- range $name, $value := . -}}
{{- $pairs = append $pairs (printf "%s=%v" $name $value) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
