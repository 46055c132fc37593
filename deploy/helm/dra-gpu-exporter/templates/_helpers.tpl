{{/* Name of every object of the release; "dra-gpu-exporter" for a release of that name. */}}
{{- define "dge.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "dge.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/part-of: {{ .Chart.Name }}
{{- end -}}

{{- define "dge.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- end -}}

{{/* The agent's user name in the API server, as the admission policies match it. */}}
{{- define "dge.username" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "dge.fullname" . }}
{{- end -}}

{{- define "dge.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* The node-name claim of the pod-bound service-account token, '' when absent. */}}
{{- define "dge.nodeNameVariable" -}}
- name: nodeName
  expression: >-
    has(request.userInfo.extra) &&
    'authentication.kubernetes.io/node-name' in request.userInfo.extra &&
    size(request.userInfo.extra['authentication.kubernetes.io/node-name']) == 1
    ? request.userInfo.extra['authentication.kubernetes.io/node-name'][0] : ''
{{- end -}}

{{/* NetworkPolicy: one peer from a namespaceSelector and a podSelector (both set: AND), as a
    YAML list; "" when both are empty. */}}
{{- define "dge.networkPeer" -}}
{{- $peer := dict -}}
{{- with .namespaceSelector }}{{ $_ := set $peer "namespaceSelector" . }}{{ end -}}
{{- with .podSelector }}{{ $_ := set $peer "podSelector" . }}{{ end -}}
{{- if $peer }}{{ toYaml (list $peer) }}{{ end -}}
{{- end -}}
