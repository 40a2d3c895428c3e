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
