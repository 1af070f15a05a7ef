{{/* Redis, for quotas shared by the codec replicas (database 0) and stored Responses (database 1): the bundled
     one (a password from a Secret, TLS as an option) or an external one (a URL, or a Secret holding one). */}}

{{- define "kvrelay.redisInUse" -}}
{{- if and (or .Values.redis.quotas .Values.redis.responses) (or .Values.redis.enabled .Values.redis.external.url .Values.redis.external.existingSecret) }}true{{- end }}
{{- end }}

{{- define "kvrelay.redisPasswordSecretName" -}}
{{- default (include "kvrelay.componentName" (dict "root" . "component" "redis-auth")) .Values.redis.auth.existingSecret }}
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
{{- $host := include "kvrelay.componentName" (dict "root" .root "component" "redis") }}
{{- if .root.Values.redis.tls.enabled }}
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
