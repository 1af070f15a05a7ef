{{/* The codec's Deployment, for the codec (`component` codec) and the drainers (`component` drainer,
     `drain` true: the same pod running `kvrelay codec --drain`, with no Service in front; docs/async.md).
     Call with (dict "root" $ "component" NAME "drain" BOOL). */}}
{{- define "kvrelay.codecDeployment" -}}
{{- $component := .component }}
{{- $drain := .drain }}
{{- with .root }}
{{- $name := include "kvrelay.componentName" (dict "root" . "component" $component) }}
{{- $c := .Values.codec }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvrelay.labels" (dict "root" . "component" $component) | nindent 4 }}
spec:
  {{- if $drain }}
  replicas: {{ .Values.queue.drainer.replicas }}
  {{- else if not $c.autoscaling.enabled }}
  replicas: {{ $c.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvrelay.selectorLabels" (dict "root" . "component" $component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvrelay.labels" (dict "root" . "component" $component) | nindent 8 }}
        kvrelay.dev/state: {{ include "kvrelay.stateRelease" . }}  # whose Redis, queue and batch store it uses
      annotations:
        checksum/config: {{ include "kvrelay.configYaml" . | sha256sum }}
        kvrelay.dev/model-version: {{ .Values.model.version | quote }}
        {{- with include "kvrelay.compactionKeysChecksum" . }}
        checksum/compaction-keys: {{ . }}
        {{- end }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ add $c.preStopSleepSeconds $c.graceSeconds 10 }}
      securityContext:
        {{- toYaml .Values.podSecurityContext | nindent 8 }}
      {{- with .Values.image.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- if or .Values.model.fetch.enabled .Values.model.verify.enabled }}
      initContainers:
        {{- include "kvrelay.modelInitContainers" (dict "root" . "image" (include "kvrelay.codecImage" .) "scope" "tokenizer") | trim | nindent 8 }}
      {{- end }}
      containers:
        - name: codec
          image: {{ include "kvrelay.codecImage" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          command: ["kvrelay"]
          args:
            - codec
            - --config
            - {{ include "kvrelay.configPath" . }}
            - --router
            - {{ include "kvrelay.routerAddress" . }}
            - --model
            - {{ include "kvrelay.modelDir" . | quote }}
            - --host
            - "0.0.0.0"
            - --port
            - {{ $c.port | quote }}
            {{- if $c.grpcPort }}
            - --grpc-port
            - {{ $c.grpcPort | quote }}
            {{- end }}
            - --grace-seconds
            - {{ $c.graceSeconds | quote }}
            {{- if $drain }}
            - --drain
            {{- end }}
            {{- range $c.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "kvrelay.commonEnv" (dict "root" . "logLevel" $c.logLevel) | trim | nindent 12 }}
            {{- with include "kvrelay.redisEnv" . | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "kvrelay.queueEnv" (dict "root" . "drain" $drain) | trim }}
            # the async lane's queue (docs/async.md)
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "kvrelay.batchesEnv" . | trim }}
            # the Files and Batches APIs' store (docs/batches.md)
            {{- . | nindent 12 }}
            {{- end }}
            {{- with include "kvrelay.resultCacheEnv" . | trim }}
            # the exact-result cache in the shared KV tier's Redis (config.result_cache)
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $c.metricsPort }}
            # /metrics on its own port (server.metrics_port), no longer on the API port
            - name: KVRELAY_SERVER__METRICS_PORT
              value: {{ $c.metricsPort | quote }}
            {{- end }}
            {{- if $c.tls.enabled }}
            # HTTPS and gRPC over TLS on the API ports, re-read on change (docs/deploy.md "Entry TLS")
            - name: KVRELAY_SERVER__TLS__CERT_FILE
              value: {{ printf "%s/tls.crt" (include "kvrelay.entryTlsDir" .) | quote }}
            - name: KVRELAY_SERVER__TLS__KEY_FILE
              value: {{ printf "%s/tls.key" (include "kvrelay.entryTlsDir" .) | quote }}
            - name: KVRELAY_SERVER__TLS__RELOAD_INTERVAL_S
              value: {{ $c.tls.reloadSeconds | quote }}
            {{- end }}
            {{- if .Values.responses.compactionKeys.existingSecret }}
            # Read once at start; the pods roll on a change (checksum/compaction-keys, docs/deploy.md).
            - name: KVRELAY_RESPONSES__COMPACTION_KEYS_FILE
              value: {{ printf "%s/%s" (include "kvrelay.compactionKeysDir" .) .Values.responses.compactionKeys.key | quote }}
            {{- end }}
            {{- with $c.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $c.port }}
              protocol: TCP
            {{- if $c.grpcPort }}
            - name: grpc
              containerPort: {{ $c.grpcPort }}
              protocol: TCP
            {{- end }}
            {{- if $c.metricsPort }}
            - name: metrics
              containerPort: {{ $c.metricsPort }}
              protocol: TCP
            {{- end }}
          # /health answers while the process serves HTTP; /ready only when the router answers with the
          # same tokenizer fingerprint (services/codec/routes_health.py).
          startupProbe:
            httpGet:
              path: /health
              port: http
              {{- if $c.tls.enabled }}
              scheme: HTTPS
              {{- end }}
            periodSeconds: 2
            failureThreshold: 60
          readinessProbe:
            httpGet:
              path: /ready
              port: http
              {{- if $c.tls.enabled }}
              scheme: HTTPS
              {{- end }}
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          livenessProbe:
            httpGet:
              path: /health
              port: http
              {{- if $c.tls.enabled }}
              scheme: HTTPS
              {{- end }}
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 3
          {{- include "kvrelay.preStop" $c.preStopSleepSeconds | nindent 10 }}
          securityContext:
            {{- toYaml .Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml (ternary .Values.queue.drainer.resources $c.resources $drain) | nindent 12 }}
          volumeMounts:
            {{- include "kvrelay.mounts" . | trim | nindent 12 }}
            {{- include "kvrelay.modelMount" . | trim | nindent 12 }}
            {{- with include "kvrelay.redisTlsMount" . | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if include "kvrelay.resultCacheInTier" . }}
            {{- with include "kvrelay.kvCacheTlsMount" . | trim }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- end }}
            {{- if .Values.auth.existingSecret }}
            - name: api-keys
              mountPath: {{ include "kvrelay.keysDir" . }}
              readOnly: true
            {{- end }}
            {{- if .Values.responses.compactionKeys.existingSecret }}
            - name: compaction-keys
              mountPath: {{ include "kvrelay.compactionKeysDir" . }}
              readOnly: true
            {{- end }}
            {{- if $c.tls.enabled }}
            - name: entry-tls
              mountPath: {{ include "kvrelay.entryTlsDir" . }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "kvrelay.volumes" . | trim | nindent 8 }}
        {{- include "kvrelay.modelVolume" . | trim | nindent 8 }}
        {{- with include "kvrelay.redisTlsVolume" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if include "kvrelay.resultCacheInTier" . }}
        {{- with include "kvrelay.kvCacheTlsVolume" . | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- if .Values.auth.existingSecret }}
        # Mounted as a directory (no subPath) so a rotated Secret reaches the codec, which re-reads it.
        - name: api-keys
          secret:
            secretName: {{ .Values.auth.existingSecret }}
            defaultMode: 0440
        {{- end }}
        {{- if .Values.responses.compactionKeys.existingSecret }}
        # A directory too, like api-keys; the codec reads it once, so a change rolls the pods instead.
        - name: compaction-keys
          secret:
            secretName: {{ .Values.responses.compactionKeys.existingSecret }}
            defaultMode: 0440
        {{- end }}
        {{- if $c.tls.enabled }}
        # A directory (no subPath) so a renewed certificate reaches the codec, which re-reads it.
        - name: entry-tls
          secret:
            secretName: {{ $c.tls.existingSecret }}
            defaultMode: 0440
        {{- end }}
      {{- with $c.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $c.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
{{- end }}
