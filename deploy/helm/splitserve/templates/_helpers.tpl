{{/* Names, labels and the shared pieces of the pod specs. */}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; component names append "-gateway", "-prefill", ... (at most 14
characters), so it is cut to 49 to keep every name within 63. */}}
{{- define "splitserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 49 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 49 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 49 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ include "splitserve.chart" . }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end }}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: include with (dict "root" $ "component" "gateway"). */}}
{{- define "splitserve.componentLabels" -}}
{{ include "splitserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "splitserve.componentSelectorLabels" -}}
{{ include "splitserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "splitserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "splitserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "splitserve.image" -}}
{{- $tag := .Values.image.tag }}
{{- if not $tag }}
{{- $tag = .Chart.AppVersion }}
{{- if .Values.gpu.enabled }}
{{- $tag = printf "%s-cuda" $tag }}
{{- end }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The gateway's inbox as instances address it: a Service that also lists gateway pods that are
not ready yet (a gateway is only ready once instances have reported to it). */}}
{{- define "splitserve.gatewayInbox" -}}
{{- printf "tcp://%s-gateway-inbox.%s.svc:%d" (include "splitserve.fullname" .) .Release.Namespace (int .Values.gateway.inboxPort) }}
{{- end }}

{{- define "splitserve.configName" -}}
{{- printf "%s-config" (include "splitserve.fullname" .) }}
{{- end }}

{{- define "splitserve.redisSecretName" -}}
{{- if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- printf "%s-redis-url" (include "splitserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "splitserve.storePrefix" -}}
{{- default (include "splitserve.fullname" .) .Values.redis.keyPrefix }}
{{- end }}

{{/* The served name NOTES.txt shows: what the gateway derives from the model path. */}}
{{- define "splitserve.servedName" -}}
{{- if .Values.model.servedName }}
{{- .Values.model.servedName }}
{{- else if .Values.model.path }}
{{- base (trimSuffix "/" .Values.model.path) | trimSuffix ".gguf" }}
{{- else }}
{{- "SmolLM2-135M-Instruct" }}
{{- end }}
{{- end }}

{{/* Value combinations the schema cannot express; each fails with a message naming the values. */}}
{{- define "splitserve.validate" -}}
{{- if and (gt (int .Values.gateway.replicas) 1) (eq .Values.redis.mode "none") }}
{{- fail (printf "gateway.replicas is %d but redis.mode is \"none\": several gateways share one cluster through Redis; set redis.mode to \"bundled\" or \"external\"" (int .Values.gateway.replicas)) }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "redis.mode is \"external\" but neither redis.external.url nor redis.external.existingSecret is set" }}
{{- end }}
{{- if and .Values.gpu.enabled (not (hasPrefix "cuda" .Values.engine.device)) }}
{{- fail (printf "gpu.enabled is true but engine.device is %q: set engine.device to \"cuda\" (the pods would hold GPUs they do not use)" .Values.engine.device) }}
{{- end }}
{{- if and (not .Values.gpu.enabled) (hasPrefix "cuda" .Values.engine.device) }}
{{- fail (printf "engine.device is %q but gpu.enabled is false: the instance pods would request no GPU" .Values.engine.device) }}
{{- end }}
{{- if and .Values.model.path (not .Values.model.volume) (hasPrefix .Values.model.mountPath .Values.model.path) }}
{{- fail (printf "model.path %q is under model.mountPath %q but model.volume is empty: nothing is mounted there" .Values.model.path .Values.model.mountPath) }}
{{- end }}
{{- end }}

{{/* Volumes of the gateway and instance pods. */}}
{{- define "splitserve.volumes" -}}
{{- with .Values.model.volume }}
- name: model
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.cache.volume }}
- name: cache
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "splitserve.volumeMounts" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.cache.volume }}
- name: cache
  mountPath: {{ .Values.cache.dir }}
{{- end }}
{{- end }}

{{/* SPLITSERVE_REDIS_URL for the containers, when a Redis is configured; the URL may carry a
password, so an external one comes from a Secret. */}}
{{- define "splitserve.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" }}
- name: SPLITSERVE_REDIS_URL
  value: {{ printf "redis://%s-redis.%s.svc:%d/0" (include "splitserve.fullname" .) .Release.Namespace (int .Values.redis.bundled.port) | quote }}
{{- else if eq .Values.redis.mode "external" }}
- name: SPLITSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.redisSecretName" . }}
      key: {{ if .Values.redis.external.existingSecret }}{{ .Values.redis.external.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}
{{- end }}

{{/* The pod's own address and name, from the downward API: instances and gateways advertise the
pod IP to their peers (they bind 0.0.0.0), and instances use the pod name as their id. */}}
{{- define "splitserve.podEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
