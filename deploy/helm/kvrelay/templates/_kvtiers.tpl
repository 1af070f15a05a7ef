{{/* The KV tiers below each worker's pool (kvTiers): every kv_tiers key as a KVRELAY_KV_TIERS__* override on
     every worker container, the shared tier's password as KVRELAY_KV_TIERS_PASSWORD from a Secret (never in
     a URL or the config), the node directory of the disk tier, and the cache Redis of its own role (the
     bundled one, kv-cache.yaml, or an external one). Nothing at all while kvTiers.enabled is false. */}}

{{- define "kvrelay.kvTiersDiskDir" -}}/var/lib/kvrelay/kv-tiers{{- end }}
{{- define "kvrelay.kvCacheTlsDir" -}}/etc/kvrelay/kv-cache-tls{{- end }}

{{/* True when the chart runs the cache Redis (kv-cache.yaml). */}}
{{- define "kvrelay.kvCacheBundled" -}}
{{- if and .Values.kvTiers.enabled .Values.kvTiers.cacheRedis.enabled }}true{{- end }}
{{- end }}

{{- define "kvrelay.kvCachePasswordSecretName" -}}
{{- default (include "kvrelay.componentName" (dict "root" . "component" "kv-cache-auth")) .Values.kvTiers.cacheRedis.auth.existingSecret }}
{{- end }}

{{/* The cache Redis's certificates: kvTiers.cacheRedis.tls.existingSecret, else the internal TLS Secret. */}}
{{- define "kvrelay.kvCacheTlsSecretName" -}}
{{- default (include "kvrelay.internalTlsSecretName" .) .Values.kvTiers.cacheRedis.tls.existingSecret }}
{{- end }}

{{/* kv_tiers.shared_url: the bundled cache Redis (rediss:// checked against its mounted CA with TLS), the
     external URL, or empty (no shared tier). Never a password: that is KVRELAY_KV_TIERS_PASSWORD. */}}
{{- define "kvrelay.kvTiersSharedUrl" -}}
{{- $c := .Values.kvTiers.cacheRedis }}
{{- if $c.enabled }}
{{- $host := include "kvrelay.componentName" (dict "root" . "component" "kv-cache") }}
{{- if $c.tls.enabled }}
{{- printf "rediss://%s:6379/0?ssl_ca_certs=%s/ca.crt" $host (include "kvrelay.kvCacheTlsDir" .) }}
{{- else }}
{{- printf "redis://%s:6379/0" $host }}
{{- end }}
{{- else }}
{{- $c.external.url }}
{{- end }}
{{- end }}

{{/* The worker containers' env: kv_tiers.* and the password. */}}
{{- define "kvrelay.kvTiersEnv" -}}
{{- $t := .Values.kvTiers }}
{{- if $t.enabled }}
{{- $c := $t.cacheRedis }}
{{- /* int: a number from values is a float, which would print as 1e+06 */}}
{{- $keys := dict
      "segment_tokens" (int $t.segmentTokens) "ttl_s" (int $t.ttlSeconds) "timeout_ms" (int $t.timeoutMs)
      "fetch_deadline_ms" (int $t.fetchDeadlineMs) "write_mb_per_s" $t.writeMbPerS
      "host_capacity_mb" (int $t.hostCapacityMb) "tenant_capacity_mb" (int $t.tenantCapacityMb)
      "write_through" $t.writeThrough }}
{{- if $t.disk.enabled }}
{{- $_ := set $keys "disk_path" (include "kvrelay.kvTiersDiskDir" .) }}
{{- $_ := set $keys "disk_capacity_mb" (int $t.disk.capacityMb) }}
{{- end }}
{{- with include "kvrelay.kvTiersSharedUrl" . }}
{{- $_ := set $keys "shared_url" . }}
{{- end }}
{{- range $key := keys $keys | sortAlpha }}
- name: {{ printf "KVRELAY_KV_TIERS__%s" (upper $key) }}
  value: {{ index $keys $key | toString | quote }}
{{- end }}
{{- include "kvrelay.kvCachePasswordEnv" . }}
{{- end }}
{{- end }}

{{/* KVRELAY_KV_TIERS_PASSWORD from its Secret: the bundled cache Redis's, or the external one's if any. */}}
{{- define "kvrelay.kvCachePasswordEnv" -}}
{{- $c := .Values.kvTiers.cacheRedis }}
{{- if $c.enabled }}
- name: KVRELAY_KV_TIERS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvrelay.kvCachePasswordSecretName" . }}
      key: {{ $c.auth.key }}
{{- else if and $c.external.url $c.external.existingSecret }}
- name: KVRELAY_KV_TIERS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $c.external.existingSecret }}
      key: {{ $c.external.key }}
{{- end }}
{{- end }}

{{/* True when the codec keeps the exact-result cache (config.result_cache, docs/result-cache.md) in the
     shared tier's Redis: the KV tiers on with a shared tier, tenants that opted in, and no url of its
     own. The codec then gets the shared tier's URL, password and CA, and may reach the cache Redis. */}}
{{- define "kvrelay.resultCacheInTier" -}}
{{- $rc := dig "result_cache" dict (default dict .Values.config) }}
{{- if and .Values.kvTiers.enabled (include "kvrelay.kvTiersSharedUrl" .) (get $rc "tenants") (not (get $rc "url")) }}true{{- end }}
{{- end }}

{{/* The codec container's env for the result cache in the shared tier: its URL and password. */}}
{{- define "kvrelay.resultCacheEnv" -}}
{{- if include "kvrelay.resultCacheInTier" . }}
- name: KVRELAY_KV_TIERS__SHARED_URL
  value: {{ include "kvrelay.kvTiersSharedUrl" . | quote }}
{{- include "kvrelay.kvCachePasswordEnv" . }}
{{- end }}
{{- end }}

{{/* The cache Redis's CA where the pod checks its TLS certificate: workers with a shared tier, and the codec
     when it keeps the result cache there. */}}
{{- define "kvrelay.kvCacheTlsVolume" -}}
{{- if and (include "kvrelay.kvCacheBundled" .) .Values.kvTiers.cacheRedis.tls.enabled }}
- name: kv-cache-tls
  secret:
    secretName: {{ include "kvrelay.kvCacheTlsSecretName" . }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end }}

{{- define "kvrelay.kvCacheTlsMount" -}}
{{- if and (include "kvrelay.kvCacheBundled" .) .Values.kvTiers.cacheRedis.tls.enabled }}
- name: kv-cache-tls
  mountPath: {{ include "kvrelay.kvCacheTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The worker pods' volumes: the disk tier's directory (a node directory, or an emptyDir a quarter above its
     capacity, so a tier briefly past it before trimming never gets the pod evicted), the cache Redis's
     CA. */}}
{{- define "kvrelay.kvTiersVolumes" -}}
{{- $t := .Values.kvTiers }}
{{- if and $t.enabled $t.disk.enabled }}
- name: kv-tiers-disk
{{- if $t.disk.hostPath }}
  hostPath:
    path: {{ $t.disk.hostPath }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
    sizeLimit: {{ printf "%dMi" (div (mul (int $t.disk.capacityMb) 5) 4) }}
{{- end }}
{{- end }}
{{- include "kvrelay.kvCacheTlsVolume" . }}
{{- end }}

{{- define "kvrelay.kvTiersMounts" -}}
{{- $t := .Values.kvTiers }}
{{- if and $t.enabled $t.disk.enabled }}
- name: kv-tiers-disk
  mountPath: {{ include "kvrelay.kvTiersDiskDir" . }}
{{- end }}
{{- include "kvrelay.kvCacheTlsMount" . }}
{{- end }}

{{/* What the chart refuses about the KV tiers (included by kvrelay.checkValues). */}}
{{- define "kvrelay.checkKvTiers" -}}
{{- with dig "kv_tiers" dict (default dict .Values.config) }}
{{- fail (printf "config.kv_tiers (%s): the chart sets the KV tiers on each worker; set kvTiers.* instead (kvTiers.enabled, kvTiers.disk, kvTiers.cacheRedis; docs/deploy.md, \"KV tiers\")" (keys . | sortAlpha | join ", ")) }}
{{- end }}
{{- $t := .Values.kvTiers }}
{{- $c := $t.cacheRedis }}
{{- $rc := dig "result_cache" dict (default dict .Values.config) }}
{{- if and (get $rc "tenants") (not (get $rc "url")) (not (and $t.enabled (include "kvrelay.kvTiersSharedUrl" .))) }}
{{- fail "config.result_cache.tenants needs a Redis: the shared KV tier's (kvTiers.enabled with kvTiers.cacheRedis, bundled or external), or config.result_cache.url (docs/result-cache.md)" }}
{{- end }}
{{- if $t.enabled }}
{{- if not (or $t.disk.enabled $c.enabled $c.external.url (gt (int $t.hostCapacityMb) 0)) }}
{{- fail "kvTiers.enabled needs a tier: kvTiers.disk.enabled, kvTiers.cacheRedis.enabled (the chart's cache Redis), kvTiers.cacheRedis.external.url, or kvTiers.hostCapacityMb" }}
{{- end }}
{{- $blockSize := int (dig "engine" "block_size" 16 (default dict .Values.config)) }}
{{- if mod (int $t.segmentTokens) $blockSize }}
{{- fail (printf "kvTiers.segmentTokens (%v) is not a multiple of config.engine.block_size (%d): a segment is whole blocks" $t.segmentTokens $blockSize) }}
{{- end }}
{{- if and $c.enabled $c.external.url }}
{{- fail "kvTiers.cacheRedis.external.url is for an external cache Redis: set kvTiers.cacheRedis.enabled: false to use it, or leave it empty for the chart's own" }}
{{- end }}
{{- if and (not $c.enabled) $c.external.existingSecret (not $c.external.url) }}
{{- fail "kvTiers.cacheRedis.external.existingSecret holds the external cache Redis's password; its address goes in kvTiers.cacheRedis.external.url (redis:// or rediss://, without the password)" }}
{{- end }}
{{- if and (not $c.enabled) (contains ":" (urlParse (default "redis://" $c.external.url)).userinfo) }}
{{- fail "kvTiers.cacheRedis.external.url carries a password: the KV tiers take their password only from a Secret (kvTiers.cacheRedis.external.existingSecret and key, reaching the workers as KVRELAY_KV_TIERS_PASSWORD); give the URL without it" }}
{{- end }}
{{- if and (not $c.enabled) $c.tls.enabled }}
{{- fail "kvTiers.cacheRedis.tls applies to the chart's cache Redis (kvTiers.cacheRedis.enabled); for an external one give a rediss:// URL in kvTiers.cacheRedis.external.url" }}
{{- end }}
{{- if and $c.enabled $c.tls.enabled (not $c.tls.existingSecret) (not .Values.internalTls.enabled) }}
{{- fail "kvTiers.cacheRedis.tls.enabled needs kvTiers.cacheRedis.tls.existingSecret (tls.crt, tls.key, ca.crt), or internalTls.enabled, whose certificate then serves the cache Redis too" }}
{{- end }}
{{- end }}
{{- end }}
