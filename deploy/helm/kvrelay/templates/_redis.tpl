{{/* Redis, for quotas shared by the codec replicas (database 0) and stored Responses (database 1): the bundled
     one (a password from a Secret, TLS as an option) or an external one (a URL, or a Secret holding one). */}}

{{- define "kvrelay.redisInUse" -}}
{{- if and (or .Values.redis.quotas .Values.redis.responses) (or .Values.redis.enabled .Values.redis.external.url .Values.redis.external.existingSecret) }}true{{- end }}
{{- end }}

{{/* The HA Redis pods' names (redis.ha), space-separated: <set>-<i>.<headless>.<namespace>.svc, each a
     Sentinel the clients and the other pods ask; the main release's in a canary. */}}
{{- define "kvrelay.redisHaPods" -}}
{{- $set := include "kvrelay.stateName" (dict "root" . "component" "redis") }}
{{- $headless := include "kvrelay.stateName" (dict "root" . "component" "redis-headless") }}
{{- $pods := list }}
{{- range $i := until (int .Values.redis.ha.replicas) }}
{{- $pods = append $pods (printf "%s-%d.%s.%s.svc" $set $i $headless $.Release.Namespace) }}
{{- end }}
{{- join " " $pods }}
{{- end }}

{{- define "kvrelay.redisPasswordSecretName" -}}
{{- default (include "kvrelay.stateName" (dict "root" . "component" "redis-auth")) .Values.redis.auth.existingSecret }}
{{- end }}

{{/* The bundled Redis's certificates: redis.tls.existingSecret, else the internal TLS Secret. */}}
{{- define "kvrelay.redisTlsSecretName" -}}
{{- default (include "kvrelay.internalTlsSecretName" .) .Values.redis.tls.existingSecret }}
{{- end }}

{{- define "kvrelay.redisTlsDir" -}}/etc/kvrelay/redis-tls{{- end }}

{{/* A URL of the bundled Redis, its password left for the kubelet to expand from REDIS_PASSWORD (defined
     before it in the codec's env). With TLS: rediss://, checked against the mounted CA (redis-py passes
     ssl_ca_certs on to the connection). Call with (dict "root" $ "db" N). */}}
{{- define "kvrelay.bundledRedisUrl" -}}
{{- $host := include "kvrelay.stateName" (dict "root" .root "component" "redis") }}
{{- if .root.Values.redis.ha.enabled }}
{{- $sentinels := splitList " " (include "kvrelay.redisHaPods" .root) }}
{{- printf "redis+sentinel://:$(REDIS_PASSWORD)@%s/kvrelay/%d?sentinel_password=$(REDIS_PASSWORD)" (join ":26379," $sentinels | printf "%s:26379") (int .db) }}
{{- else if .root.Values.redis.tls.enabled }}
{{- printf "rediss://:$(REDIS_PASSWORD)@%s:6379/%d?ssl_ca_certs=%s/ca.crt" $host (int .db) (include "kvrelay.redisTlsDir" .root) }}
{{- else }}
{{- printf "redis://:$(REDIS_PASSWORD)@%s:6379/%d" $host (int .db) }}
{{- end }}
{{- end }}

{{/* One env entry's value for an external Redis: a literal URL, or a key of redis.external.existingSecret.
     Call with (dict "root" $ "url" URL "key" SECRET_KEY). */}}
{{- define "kvrelay.externalRedisValue" -}}
{{- if .root.Values.redis.external.existingSecret }}
valueFrom:
  secretKeyRef:
    name: {{ .root.Values.redis.external.existingSecret }}
    key: {{ .key }}
{{- else }}
value: {{ .url | quote }}
{{- end }}
{{- end }}

{{/* The codec's Redis URLs, as quotas.redis_url and responses.redis_url overrides. */}}
{{- define "kvrelay.redisEnv" -}}
{{- if include "kvrelay.redisInUse" . }}
{{- $r := .Values.redis }}
{{- if $r.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.redisPasswordSecretName" . }}
      key: {{ $r.auth.key }}
{{- if $r.quotas }}
- name: KVRELAY_QUOTAS__REDIS_URL
  value: {{ include "kvrelay.bundledRedisUrl" (dict "root" . "db" 0) | quote }}
{{- end }}
{{- if $r.responses }}
- name: KVRELAY_RESPONSES__REDIS_URL
  value: {{ include "kvrelay.bundledRedisUrl" (dict "root" . "db" 1) | quote }}
{{- end }}
{{- else }}
{{- $x := $r.external }}
{{- if $r.quotas }}
- name: KVRELAY_QUOTAS__REDIS_URL
{{- include "kvrelay.externalRedisValue" (dict "root" . "url" $x.url "key" $x.key) | nindent 2 }}
{{- end }}
{{- if $r.responses }}
- name: KVRELAY_RESPONSES__REDIS_URL
{{- include "kvrelay.externalRedisValue" (dict "root" . "url" (default $x.url $x.responsesUrl) "key" (default $x.key $x.responsesKey)) | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The codec's volume and mount of the bundled Redis's CA (redis.tls.enabled). */}}
{{- define "kvrelay.redisTlsVolume" -}}
{{- if and .Values.redis.enabled .Values.redis.tls.enabled (include "kvrelay.redisInUse" .) }}
- name: redis-tls
  secret:
    secretName: {{ include "kvrelay.redisTlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{- define "kvrelay.redisTlsMount" -}}
{{- if and .Values.redis.enabled .Values.redis.tls.enabled (include "kvrelay.redisInUse" .) }}
- name: redis-tls
  mountPath: {{ include "kvrelay.redisTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* One Redis server, Deployment and Service, for a role of its own (the bundled Redis of quotas and stored
     Responses, the KV tiers' cache Redis, the async lane's queue): a password from a Secret (requirepass),
     TLS only as an option, bounded by maxmemory with its policy. Call with a dict: root, component, tls,
     tlsSecret, passwordSecret, passwordKey, maxMemory, policy (--maxmemory-policy), image, resources, and
     claim: a PersistentVolumeClaim for an append-only file with fsync always (the queue), else none and no
     persistence. */}}
{{- define "kvrelay.redisServer" -}}
{{- $root := .root }}
{{- $name := include "kvrelay.componentName" (dict "root" $root "component" .component) }}
{{- $tlsDir := "/etc/redis/tls" }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvrelay.labels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  replicas: 1
  strategy:
    type: Recreate
  selector:
    matchLabels:
      {{- include "kvrelay.selectorLabels" (dict "root" $root "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvrelay.labels" (dict "root" $root "component" .component) | nindent 8 }}
    spec:
      automountServiceAccountToken: false
      securityContext:
        runAsNonRoot: true
        runAsUser: 999
        runAsGroup: 999
        fsGroup: 999
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: redis
          image: {{ include "kvrelay.pinned" (dict "reference" (printf "%s:%s" .image.repository .image.tag) "digest" .image.digest) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["redis-server"]
          # The kubelet expands $(REDIS_PASSWORD) from the env below.
          args:
            {{- if .tls }}
            - --port
            - "0"
            - --tls-port
            - "6379"
            - --tls-cert-file
            - {{ printf "%s/tls.crt" $tlsDir }}
            - --tls-key-file
            - {{ printf "%s/tls.key" $tlsDir }}
            - --tls-ca-cert-file
            - {{ printf "%s/ca.crt" $tlsDir }}
            # The password authenticates clients; they present no certificate.
            - --tls-auth-clients
            - "no"
            {{- else }}
            - --port
            - "6379"
            {{- end }}
            - --requirepass
            - $(REDIS_PASSWORD)
            - --save
            - ""
            {{- if .claim }}
            # every write in the append-only file before it is acknowledged (the queue role)
            - --appendonly
            - "yes"
            - --appendfsync
            - always
            {{- else }}
            - --appendonly
            - "no"
            {{- end }}
            - --maxmemory
            - {{ .maxMemory | quote }}
            - --maxmemory-policy
            - {{ .policy }}
          env:
            - name: REDIS_PASSWORD
              valueFrom:
                secretKeyRef:
                  name: {{ .passwordSecret }}
                  key: {{ .passwordKey }}
            - name: REDISCLI_AUTH  # redis-cli's password (the readiness probe)
              value: $(REDIS_PASSWORD)
          ports:
            - name: redis
              containerPort: 6379
              protocol: TCP
          readinessProbe:
            exec:
              {{- if .tls }}
              command: ["redis-cli", "--tls", "--cacert", {{ printf "%s/ca.crt" $tlsDir | quote }}, "ping"]
              {{- else }}
              command: ["redis-cli", "ping"]
              {{- end }}
            periodSeconds: 5
          livenessProbe:
            tcpSocket:
              port: redis
            periodSeconds: 10
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml .resources | nindent 12 }}
          volumeMounts:
            - name: data
              mountPath: /data
            {{- if .tls }}
            - name: tls
              mountPath: {{ $tlsDir }}
              readOnly: true
            {{- end }}
      volumes:
        - name: data
          {{- if .claim }}
          persistentVolumeClaim:
            claimName: {{ .claim }}
          {{- else }}
          emptyDir:
            sizeLimit: 1Gi
          {{- end }}
        {{- if .tls }}
        - name: tls
          secret:
            secretName: {{ .tlsSecret }}
            defaultMode: 0440
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "kvrelay.labels" (dict "root" $root "component" .component) | nindent 4 }}
spec:
  type: ClusterIP
  selector:
    {{- include "kvrelay.selectorLabels" (dict "root" $root "component" .component) | nindent 4 }}
  ports:
    - name: redis
      port: 6379
      targetPort: redis
      protocol: TCP
{{- end }}
