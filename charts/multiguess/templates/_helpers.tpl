{{/* Names are cut to 63 characters: the limit for labels and DNS names. */}}
{{- define "multiguess.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "multiguess.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "multiguess.selectorLabels" -}}
app.kubernetes.io/name: {{ include "multiguess.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "multiguess.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "multiguess.labels" -}}
helm.sh/chart: {{ include "multiguess.chart" . }}
{{ include "multiguess.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: multiguess
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "multiguess.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "multiguess.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given. Call with (list image appVersion). */}}
{{- define "multiguess.imageRef" -}}
{{- $image := index . 0 -}}
{{- $appVersion := index . 1 -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $appVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Labels the operator puts on the target pods and API Service of every SpeculativeDeployment. */}}
{{- define "multiguess.servingSelector" -}}
matchLabels:
  app.kubernetes.io/name: multiguess
  app.kubernetes.io/managed-by: multiguess-operator
  app.kubernetes.io/component: target
{{- end -}}

{{/* The rules the operator needs where its resources live (multiguess_operator.rbac.NAMESPACE_RULES). */}}
{{- define "multiguess.namespacedRules" -}}
# The custom resource: kopf watches it and patches finalizers, status and (autoscaler) scale.
- apiGroups: [multiguess.io]
  resources: [speculativedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [multiguess.io]
  resources: [speculativedeployments/status, speculativedeployments/scale]
  verbs: [patch]
# Children, server-side applied (an apply that creates needs create) and watched for drift.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# The draft protocol's secret: created once, never read.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# The autoscaler lists target pods to scrape their /metrics.
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* Where the example resource goes: a watched namespace (the first), else the release's. */}}
{{- define "multiguess.exampleNamespace" -}}
{{- .Values.example.namespace | default (first .Values.operator.namespaces) | default .Release.Namespace -}}
{{- end -}}
