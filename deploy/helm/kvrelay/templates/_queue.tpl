{{/* The async lane's queue (queue.enabled, docs/async.md): a Redis of its own role and its drainers. */}}

{{/* "true" when the chart runs the queue's Redis (queue.enabled, no queue.redis.external.existingSecret). */}}
{{- define "kvrelay.queueBundled" -}}
{{- if and .Values.queue.enabled (not .Values.queue.redis.external.existingSecret) }}true{{ end }}
{{- end }}

{{- define "kvrelay.queuePasswordSecretName" -}}
{{- default (include "kvrelay.stateName" (dict "root" . "component" "queue-auth")) .Values.queue.redis.auth.existingSecret }}
{{- end }}

{{- define "kvrelay.queueClaimName" -}}
{{- include "kvrelay.componentName" (dict "root" . "component" "queue-data") }}
{{- end }}

{{/* A codec's or drainer's queue settings (KVRELAY_QUEUE__*), the password expanded by the kubelet from
     QUEUE_PASSWORD, defined first. Call with (dict "root" $ "drain" BOOL). */}}
{{- define "kvrelay.queueEnv" -}}
{{- $root := .root }}
{{- if $root.Values.queue.enabled }}
{{- $q := $root.Values.queue }}
{{- if $q.redis.external.existingSecret }}
# an external queue Redis (redis://, rediss:// or redis+sentinel://) from its Secret
- name: KVRELAY_QUEUE__URL
  valueFrom:
    secretKeyRef:
      name: {{ $q.redis.external.existingSecret }}
      key: {{ $q.redis.external.key }}
{{- else }}
- name: QUEUE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.queuePasswordSecretName" $root }}
      key: {{ $q.redis.auth.key }}
- name: KVRELAY_QUEUE__URL
  value: {{ printf "redis://:$(QUEUE_PASSWORD)@%s:6379/0" (include "kvrelay.stateName" (dict "root" $root "component" "queue")) | quote }}
{{- end }}
- name: KVRELAY_QUEUE__KEY_PREFIX
  value: {{ $q.keyPrefix | quote }}
- name: KVRELAY_QUEUE__CLAIM_AFTER_MS
  value: {{ $q.claimAfterMs | quote }}
{{- if .drain }}
- name: KVRELAY_QUEUE__DRAIN_CONCURRENCY
  value: {{ $q.drainer.concurrency | quote }}
- name: KVRELAY_QUEUE__DRAIN_MAX_WAITING
  value: {{ $q.drainer.maxWaiting | quote }}
{{- end }}
{{- end }}
{{- end }}
