{{/* The release's resource name: the release name, or release-chart when it lacks the chart's. */}}
{{- define "batchserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "batchserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "batchserve.labels" -}}
{{ include "batchserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The PersistentVolumeClaim holding the model store (modelStore.type pvc). */}}
{{- define "batchserve.claimName" -}}
{{- if .Values.modelStore.pvc.claimName -}}
{{- .Values.modelStore.pvc.claimName -}}
{{- else if .Values.modelStore.pvc.create -}}
{{- printf "%s-models" (include "batchserve.fullname" .) -}}
{{- else -}}
{{- fail "modelStore.type pvc needs modelStore.pvc.claimName, or modelStore.pvc.create" -}}
{{- end -}}
{{- end -}}

{{/*
config.properties. Inference, metrics and gRPC inference bind every address (the Service and
Prometheus reach them); management binds the loopback unless exposed. Models come from the
chart's list: load_models names the archives, models carries their settings.
*/}}
{{- define "batchserve.configProperties" -}}
{{- $ports := .Values.ports -}}
{{- $managementHost := ternary "0.0.0.0" "127.0.0.1" .Values.management.expose -}}
{{- $load := list -}}
{{- $settings := dict -}}
{{- range $model := .Values.models -}}
{{- with $model -}}
{{- if hasKey $settings .name -}}
{{- fail (printf "models: %s is listed twice" .name) -}}
{{- end -}}
{{- if and .minWorkers .maxWorkers (lt (int .maxWorkers) (int .minWorkers)) -}}
{{- fail (printf "models: %s has maxWorkers below minWorkers" .name) -}}
{{- end -}}
{{- $load = append $load (printf "%s=%s" .name .mar) -}}
{{- $entry := dict "marName" .mar -}}
{{- range $key := list "minWorkers" "maxWorkers" "batchSize" "maxBatchDelay" "responseTimeout" -}}
{{- if hasKey $model $key -}}
{{- $_ := set $entry $key (index $model $key) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $settings .name (dict .version $entry) -}}
{{- end -}}
{{- end -}}
inference_address=http://0.0.0.0:{{ $ports.inference }}
management_address=http://{{ $managementHost }}:{{ $ports.management }}
metrics_address=http://0.0.0.0:{{ $ports.metrics }}
grpc_inference_address=0.0.0.0
grpc_inference_port={{ $ports.grpcInference }}
grpc_management_address={{ $managementHost }}
grpc_management_port={{ $ports.grpcManagement }}
model_store=/mnt/models/model-store
load_models={{ join "," $load }}
models={{ toJson $settings }}
number_of_gpu={{ int .Values.gpus }}
disable_token_authorization={{ not .Values.tokenAuthorization }}
metrics_mode=prometheus
# Each pod starts from this file: no snapshot of a pod's management changes outlives it.
snapshot_disabled=true
log_location=/tmp/batchserve/logs
{{- range $key, $value := .Values.config }}
{{ $key }}={{ include "batchserve.property" $value }}
{{- end }}
{{- end -}}

{{/* A config.properties value: whole numbers as integers (values hold numbers as floats, which
print as 6.5535e+06 from a million up). */}}
{{- define "batchserve.property" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}
