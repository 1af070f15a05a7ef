{{/* Batches (batches.enabled, docs/batches.md): the batch store, PostgreSQL, bundled or external. */}}

{{- define "kvrelay.batchStorePasswordSecretName" -}}
{{- default (include "kvrelay.stateName" (dict "root" . "component" "batch-store-auth")) .Values.batches.store.auth.existingSecret }}
{{- end }}

{{- define "kvrelay.batchStoreClaimName" -}}
{{- include "kvrelay.componentName" (dict "root" . "component" "batch-store-data") }}
{{- end }}

{{/* "true" when the chart runs the batch store itself. */}}
{{- define "kvrelay.batchStoreBundled" -}}
{{- if and .Values.batches.enabled .Values.batches.store.bundled }}true{{ end }}
{{- end }}

{{/* A codec's or drainer's batch settings (KVRELAY_BATCHES__*): the store's URL, the bundled one's password
     expanded by the kubelet from BATCH_STORE_PASSWORD, defined first; an external one's URL from its Secret. */}}
{{- define "kvrelay.batchesEnv" -}}
{{- if .Values.batches.enabled }}
{{- $b := .Values.batches }}
{{- if $b.store.bundled }}
- name: BATCH_STORE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.batchStorePasswordSecretName" . }}
      key: {{ $b.store.auth.key }}
- name: KVRELAY_BATCHES__STORE_URL
  value: {{ printf "postgresql://kvrelay:$(BATCH_STORE_PASSWORD)@%s:5432/kvrelay" (include "kvrelay.stateName" (dict "root" . "component" "batch-store")) | quote }}
{{- else }}
- name: KVRELAY_BATCHES__STORE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $b.store.external.existingSecret }}
      key: {{ $b.store.external.key }}
{{- end }}
- name: KVRELAY_BATCHES__MAX_FILE_BYTES
  value: {{ $b.maxFileBytes | quote }}
- name: KVRELAY_BATCHES__MAX_LINES
  value: {{ $b.maxLines | quote }}
{{- end }}
{{- end }}
