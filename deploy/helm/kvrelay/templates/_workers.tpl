{{/* Worker containers: shared by the prefill and decode stages (workers.yaml, one container per pod) and
     the paired stage (paired.yaml, a prefill and a decode container in one pod). */}}

{{/* Engine settings a GPU worker gets as KVRELAY_ENGINE__* overrides of the shared config file: the
     device, its share of the GPU's memory, and CUDA graphs when set. Call with
     (dict "root" $ "share" GPU_MEMORY_UTILIZATION). Nothing on CPU workers, where
     engine.kv_cache_memory_mb sizes the KV cache instead. */}}
{{- define "kvrelay.engineEnv" -}}
{{- $gpu := .root.Values.gpu }}
{{- if $gpu.enabled }}
{{- $engine := default dict (get (default dict .root.Values.config) "engine") }}
{{- range $key, $value := dict "device" "gpu.device" "gpu_memory_utilization" "gpu.memoryUtilization (paired: paired.<role>.gpuMemoryUtilization)" "cuda_graphs" "gpu.cudaGraphs" }}
{{- if hasKey $engine $key }}
{{- fail (printf "config.engine.%s: with gpu.enabled the chart sets it on each GPU worker; set %s instead" $key $value) }}
{{- end }}
{{- end }}
- name: KVRELAY_ENGINE__DEVICE
  value: {{ $gpu.device | quote }}
- name: KVRELAY_ENGINE__GPU_MEMORY_UTILIZATION
  value: {{ .share | quote }}
{{- if not (kindIs "invalid" $gpu.cudaGraphs) }}
- name: KVRELAY_ENGINE__CUDA_GRAPHS
  value: {{ $gpu.cudaGraphs | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* One `kvrelay worker` container. Call with a dict:
     root, name (the container's), role, logLevel, port, metricsPort, portPrefix ("" or e.g. "prefill-": the
     container port names are <portPrefix>grpc and <portPrefix>metrics, unique within the pod), workerName
     (--name), threads, graceSeconds, preStopSleepSeconds, startupProbe, extraArgs, extraEnv, resources,
     share (engine.gpu_memory_utilization on a GPU), and mounts (extra volumeMounts). */}}
{{- define "kvrelay.workerContainer" -}}
{{- $root := .root }}
- name: {{ .name }}
  image: {{ include "kvrelay.workerImage" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["kvrelay"]
  args:
    - worker
    - --config
    - {{ include "kvrelay.configPath" $root }}
    - --role
    - {{ .role }}
    - --model
    - {{ include "kvrelay.modelDir" $root | quote }}
    - --host
    - "0.0.0.0"
    - --port
    - {{ .port | quote }}
    - --metrics-port
    - {{ .metricsPort | quote }}
    {{- if .threads }}
    - --threads
    - {{ .threads | quote }}
    {{- end }}
    - --name
    - {{ .workerName }}
    - --grace-seconds
    - {{ .graceSeconds | quote }}
    {{- range .extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "kvrelay.commonEnv" (dict "root" $root "logLevel" .logLevel) | trim | nindent 4 }}
    {{- with include "kvrelay.engineEnv" (dict "root" $root "share" .share) | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "kvrelay.kvTiersEnv" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if $root.Values.gpu.enabled }}
    {{- with $root.Values.gpu.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- end }}
    {{- with .extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ .portPrefix }}grpc
      containerPort: {{ .port }}
      protocol: TCP
    - name: {{ .portPrefix }}metrics
      containerPort: {{ .metricsPort }}
      protocol: TCP
  # grpc.health.v1: "" is SERVING once the model is loaded and warmed up (and turns NOT_SERVING
  # on SIGTERM, so the endpoint stops taking requests while in-flight ones drain);
  # "kvrelay.liveness" fails when the engine loop stops stepping while work waits.
  startupProbe:
    {{- include "kvrelay.grpcProbe" (dict "root" $root "port" .port "service" "") | nindent 4 }}
    periodSeconds: {{ .startupProbe.periodSeconds }}
    timeoutSeconds: 3
    failureThreshold: {{ .startupProbe.failureThreshold }}
  readinessProbe:
    {{- include "kvrelay.grpcProbe" (dict "root" $root "port" .port "service" "") | nindent 4 }}
    periodSeconds: 5
    timeoutSeconds: 3
    failureThreshold: 2
  livenessProbe:
    {{- include "kvrelay.grpcProbe" (dict "root" $root "port" .port "service" "kvrelay.liveness") | nindent 4 }}
    periodSeconds: 10
    timeoutSeconds: 3
    failureThreshold: 3
  {{- include "kvrelay.preStop" .preStopSleepSeconds | nindent 2 }}
  securityContext:
    {{- toYaml $root.Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  volumeMounts:
    {{- include "kvrelay.mounts" $root | trim | nindent 4 }}
    {{- include "kvrelay.modelMount" $root | trim | nindent 4 }}
    - name: dshm
      mountPath: /dev/shm
    {{- with include "kvrelay.kvTiersMounts" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end }}
