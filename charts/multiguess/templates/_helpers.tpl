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
