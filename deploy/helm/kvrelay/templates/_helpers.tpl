{{/* Names ------------------------------------------------------------------------------------- */}}

{{- define "kvrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix: the release name (so the decode Deployment is <release>-decode), or
     fullnameOverride. */}}
{{- define "kvrelay.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{/* "<fullname>-<component>", e.g. the decode Deployment and its headless Service. */}}
{{- define "kvrelay.componentName" -}}
{{- printf "%s-%s" (include "kvrelay.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Grey release (greyRelease.main): the release whose state this one uses, its bundled Redis, queue Redis and
     batch store (their Services, password Secrets and pods); itself when greyRelease.main is empty. */}}
{{- define "kvrelay.stateRelease" -}}
{{- default (include "kvrelay.fullname" .) .Values.greyRelease.main }}
{{- end }}

{{/* "<state release>-<component>": a stateful component's Service or Secret, the main release's in a canary. */}}
{{- define "kvrelay.stateName" -}}
{{- printf "%s-%s" (include "kvrelay.stateRelease" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "true" unless this release is a canary using another release's state (it then renders none of its own). */}}
{{- define "kvrelay.ownsState" -}}
{{- if not .Values.greyRelease.main }}true{{ end }}
{{- end }}

{{- define "kvrelay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "codec"). */}}
{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrelay.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvrelay.labels" -}}
helm.sh/chart: {{ include "kvrelay.chart" .root }}
{{ include "kvrelay.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvrelay
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Images ------------------------------------------------------------------------------------ */}}

{{- define "kvrelay.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{- define "kvrelay.repository" -}}
{{- if .root.Values.image.registry }}
{{- printf "%s/%s" (trimSuffix "/" .root.Values.image.registry) .repository }}
{{- else }}
{{- .repository }}
{{- end }}
{{- end }}

{{/* An image reference: "repository:tag", pinned as "repository:tag@sha256:..." when a digest is set
     (the runtime pulls by the digest; the tag stays for people reading the manifest).
     Call with (dict "reference" "repository:tag" "digest" DIGEST). */}}
{{- define "kvrelay.pinned" -}}
{{- if .digest }}
{{- printf "%s@%s" .reference .digest }}
{{- else }}
{{- .reference }}
{{- end }}
{{- end }}

{{- define "kvrelay.codecImage" -}}
{{- $reference := printf "%s:%s" (include "kvrelay.repository" (dict "root" . "repository" .Values.image.codec.repository)) (include "kvrelay.imageTag" .) }}
{{- include "kvrelay.pinned" (dict "reference" $reference "digest" .Values.image.codec.digest) }}
{{- end }}

{{- define "kvrelay.routerImage" -}}
{{- $reference := printf "%s:%s" (include "kvrelay.repository" (dict "root" . "repository" .Values.image.router.repository)) (include "kvrelay.imageTag" .) }}
{{- include "kvrelay.pinned" (dict "reference" $reference "digest" .Values.image.router.digest) }}
{{- end }}

{{/* The worker image: the -cuda variant with GPUs, else -cpu; image.worker.digest pins that variant. */}}
{{- define "kvrelay.workerImage" -}}
{{- $variant := ternary "cuda" "cpu" .Values.gpu.enabled }}
{{- $reference := printf "%s:%s-%s" (include "kvrelay.repository" (dict "root" . "repository" .Values.image.worker.repository)) (include "kvrelay.imageTag" .) $variant }}
{{- include "kvrelay.pinned" (dict "reference" $reference "digest" .Values.image.worker.digest) }}
{{- end }}

{{/* Paths and names shared by templates ------------------------------------------------------ */}}

{{- define "kvrelay.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.version }}
{{- end }}

{{- define "kvrelay.configPath" -}}/etc/kvrelay/config/config.yaml{{- end }}
{{- define "kvrelay.keysDir" -}}/etc/kvrelay/keys{{- end }}
{{- define "kvrelay.compactionKeysDir" -}}/etc/kvrelay/compaction-keys{{- end }}
{{- define "kvrelay.entryTlsDir" -}}/etc/kvrelay/entry-tls{{- end }}
{{- define "kvrelay.tokenDir" -}}/var/run/kvrelay/internal-token{{- end }}

{{- define "kvrelay.tokenSecretName" -}}
{{- default (include "kvrelay.componentName" (dict "root" . "component" "internal-token")) .Values.internalToken.existingSecret }}
{{- end }}

{{- define "kvrelay.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "kvrelay.componentName" (dict "root" . "component" "router")) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The router's gRPC address inside the cluster (what the codec dials). */}}
{{- define "kvrelay.routerAddress" -}}
{{- printf "%s:%v" (include "kvrelay.componentName" (dict "root" . "component" "router")) .Values.router.port }}
{{- end }}

{{/* The kvrelay config file: values' `config`, then what the chart decides (the chart wins; the keys
     it sets through the environment are refused under `config` by kvrelay.checkValues). */}}
{{- define "kvrelay.configYaml" -}}
{{- $cfg := deepCopy (default dict .Values.config) }}
{{- $model := dict "path" (include "kvrelay.modelDir" .) }}
{{- if .Values.model.servedName }}{{- $_ := set $model "served_name" .Values.model.servedName }}{{- end }}
{{- $_ := set $cfg "model" (merge $model (default dict (get $cfg "model"))) }}
{{- $_ := set $cfg "server" (merge (dict "host" "0.0.0.0" "port" (int .Values.codec.port)) (default dict (get $cfg "server"))) }}
{{- /* Several router replicas: each must home a session where the others do (rendezvous hashing). */}}
{{- $_ := set $cfg "router" (merge (default dict (get $cfg "router")) (dict "affinity" "shared")) }}
{{- $auth := default dict (get $cfg "auth") }}
{{- if .Values.auth.existingSecret }}
{{- $_ := set $auth "keys_file" (printf "%s/%s" (include "kvrelay.keysDir" .) .Values.auth.key) }}
{{- else if .Values.auth.allowOpen }}
{{- $_ := set $auth "allow_open" true }}
{{- end }}
{{- if $auth }}{{- $_ := set $cfg "auth" $auth }}{{- end }}
{{- if and (include "kvrelay.redisInUse" .) .Values.redis.quotas }}
{{- $quotas := default dict (get $cfg "quotas") }}
{{- $_ := set $quotas "backend" "redis" }}
{{- /* Redis down (a lone pod restarting, or the moments of an HA failover): each codec checks every limit
       divided by the codec replicas last seen alive, or by the most there can be when none was ever seen;
       never more than the limit. config.quotas.fail_open: false refuses with 503 instead. */}}
{{- if not (hasKey $quotas "fail_open") }}{{- $_ := set $quotas "fail_open" true }}{{- end }}
{{- if not (hasKey $quotas "fallback_replicas") }}
{{- $replicas := ternary .Values.codec.autoscaling.maxReplicas .Values.codec.replicas .Values.codec.autoscaling.enabled }}
{{- $_ := set $quotas "fallback_replicas" (max 1 (int $replicas)) }}
{{- end }}
{{- $_ := set $cfg "quotas" $quotas }}
{{- end }}
{{- if and (include "kvrelay.redisInUse" .) .Values.redis.responses }}
{{- $responses := default dict (get $cfg "responses") }}
{{- $_ := set $responses "key_prefix" .Values.redis.responsesKeyPrefix }}
{{- $_ := set $cfg "responses" $responses }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* Environment every kvrelay server container gets: the internal token as a file, its log level, the
     internal TLS files. Call with (dict "root" $ "logLevel" STAGE_LOG_LEVEL). */}}
{{- define "kvrelay.commonEnv" -}}
- name: KVRELAY_INTERNAL_TOKEN_FILE
  value: {{ printf "%s/%s" (include "kvrelay.tokenDir" .root) .root.Values.internalToken.key | quote }}
- name: KVRELAY_LOGGING__LEVEL
  value: {{ default .root.Values.logLevel .logLevel | quote }}
{{- include "kvrelay.internalTlsEnv" .root }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}

{{/* Volumes and mounts ------------------------------------------------------------------------ */}}

{{/* Pod volumes for a kvrelay server: config, token, internal TLS (internalTls.enabled), /tmp. */}}
{{- define "kvrelay.volumes" -}}
- name: config
  configMap:
    name: {{ include "kvrelay.componentName" (dict "root" . "component" "config") }}
- name: internal-token
  secret:
    secretName: {{ include "kvrelay.tokenSecretName" . }}
    defaultMode: 0440
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  secret:
    secretName: {{ include "kvrelay.internalTlsSecretName" . }}
    defaultMode: 0440
{{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end }}

{{- define "kvrelay.modelVolume" -}}
{{- if .Values.model.fetch.enabled }}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.model.fetch.sizeLimit }}
{{- else }}
- name: model
{{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kvrelay.mounts" -}}
- name: config
  mountPath: /etc/kvrelay/config
  readOnly: true
- name: internal-token
  mountPath: {{ include "kvrelay.tokenDir" . }}
  readOnly: true
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  mountPath: {{ include "kvrelay.internalTlsDir" . }}
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "kvrelay.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}

{{/* Init containers that bring (fetch) and check (verify) the model directory.
     Call with (dict "root" $ "image" IMAGE "scope" "model"|"tokenizer"). */}}
{{- define "kvrelay.modelInitContainers" -}}
{{- $root := .root }}
{{- if $root.Values.model.fetch.enabled }}
{{- if not $root.Values.model.fetch.command }}
{{- fail "model.fetch.command is required when model.fetch.enabled is true" }}
{{- end }}
- name: fetch-model
  image: {{ default (include "kvrelay.workerImage" $root) $root.Values.model.fetch.image }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
{{- toYaml $root.Values.model.fetch.command | nindent 4 }}
  env:
    - name: KVRELAY_MODEL_DIR
      value: {{ include "kvrelay.modelDir" $root | quote }}
    - name: KVRELAY_MODEL_VERSION
      value: {{ $root.Values.model.version | quote }}
    - name: KVRELAY_FETCH_SCOPE
      value: {{ .scope }}
{{- with $root.Values.model.fetch.env }}
{{- toYaml . | nindent 4 }}
{{- end }}
  securityContext:
{{- toYaml $root.Values.securityContext | nindent 4 }}
{{- with $root.Values.model.fetch.resources }}
  resources:
{{- toYaml . | nindent 4 }}
{{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $root.Values.model.mountPath }}
      readOnly: false  # the only writer; every other container mounts it read-only
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- if $root.Values.model.verify.enabled }}
- name: verify-model
  image: {{ .image }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["kvrelay-verify-model"]
  args:
    - {{ include "kvrelay.modelDir" $root | quote }}
    - --scope
    - {{ .scope }}
{{- if $root.Values.model.fingerprint }}
    - --expect-fingerprint
    - {{ $root.Values.model.fingerprint | quote }}
{{- end }}
  securityContext:
{{- toYaml $root.Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 100m, memory: 128Mi}
    limits: {memory: 512Mi}
  volumeMounts:
{{- include "kvrelay.modelMount" $root | nindent 4 }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* A preStop hook that waits, so endpoints stop receiving traffic before SIGTERM starts the drain. */}}
{{- define "kvrelay.preStop" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ . }}"]
{{- end }}

{{/* A checksum of the compaction keys Secret as the cluster holds it, for the codec pods' annotation:
     the codec reads the keys once, at start, so `helm upgrade` after a change to the Secret must roll it.
     Empty where nothing can be looked up (`helm template`, or the Secret not created yet). */}}
{{- define "kvrelay.compactionKeysChecksum" -}}
{{- $ck := .Values.responses.compactionKeys }}
{{- if $ck.existingSecret }}
{{- $secret := lookup "v1" "Secret" .Release.Namespace $ck.existingSecret }}
{{- with get (default dict $secret) "data" }}
{{- get . $ck.key | sha256sum }}
{{- end }}
{{- end }}
{{- end }}

{{/* True when codec pods would each seal compaction items with a key of their own: several replicas and
     no compaction keys Secret, and nobody said that was accepted. */}}
{{- define "kvrelay.compactionKeysSplit" -}}
{{- $ck := .Values.responses.compactionKeys }}
{{- $c := .Values.codec }}
{{- if and (not $ck.existingSecret) (not $ck.allowEphemeral) (or $c.autoscaling.enabled (gt (int $c.replicas) 1)) }}true{{- end }}
{{- end }}
