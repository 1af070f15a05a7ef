{{/* What the chart refuses to render, each refusal naming the values to set. Included by configmap.yaml,
     which every render has. */}}
{{- define "kvrelay.checkValues" -}}
{{- if not (or .Values.auth.existingSecret .Values.auth.allowOpen) }}
{{- fail "no API keys: set auth.existingSecret to a Secret holding the keys file made by `kvrelay keys add` (docs/admission.md), or set auth.allowOpen: true to serve in open mode (no key checked; every caller is tenant \"default\", sharing one prefix cache and one stored-Responses namespace)" }}
{{- end }}
{{- $tls := .Values.internalTls }}
{{- if and $tls.enabled (not (or $tls.existingSecret $tls.certManager.enabled)) }}
{{- fail "internalTls.enabled needs its certificate: internalTls.existingSecret (a Secret with tls.crt, tls.key and ca.crt), or internalTls.certManager.enabled with internalTls.certManager.issuerRef" }}
{{- end }}
{{- if and $tls.enabled $tls.certManager.enabled (not $tls.certManager.issuerRef.name) }}
{{- fail "internalTls.certManager.enabled needs internalTls.certManager.issuerRef.name (an Issuer or ClusterIssuer that fills ca.crt, e.g. a CA issuer)" }}
{{- end }}
{{- if and .Values.redis.ha.enabled (not .Values.redis.enabled) }}
{{- fail "redis.ha.enabled applies to the bundled Redis (redis.enabled); for an external HA Redis give a redis+sentinel:// URL in redis.external" }}
{{- end }}
{{- if and .Values.codec.tls.enabled .Values.ingress.enabled (eq .Values.ingress.backendTls "passthrough") .Values.ingress.canary.enabled }}
{{- fail "ingress.canary with ingress.backendTls passthrough: ingress-nginx splits a canary only where it terminates TLS; use backendTls reencrypt, or the Gateway API's canary" }}
{{- end }}
{{- if and .Values.codec.tls.enabled (not .Values.codec.metricsPort) .Values.metrics.serviceMonitor.enabled }}
{{- fail "codec.tls with codec.metricsPort 0: /metrics would be on the TLS port, which the ServiceMonitor scrapes in plain HTTP; keep codec.metricsPort (metrics stay plain on their own port)" }}
{{- end }}
{{- if and .Values.redis.ha.enabled .Values.redis.tls.enabled }}
{{- fail "redis.ha and redis.tls together are not rendered: the bundled HA Redis speaks plain TCP inside the NetworkPolicies; for TLS use an external HA Redis (redis.enabled: false, a rediss+sentinel:// URL)" }}
{{- end }}
{{- if and .Values.redis.tls.enabled (not .Values.redis.enabled) }}
{{- fail "redis.tls applies to the bundled Redis (redis.enabled); for an external Redis give a rediss:// URL in redis.external" }}
{{- end }}
{{- if and .Values.redis.tls.enabled (not .Values.redis.tls.existingSecret) (not $tls.enabled) }}
{{- fail "redis.tls.enabled needs redis.tls.existingSecret (tls.crt, tls.key, ca.crt), or internalTls.enabled, whose certificate then serves Redis too" }}
{{- end }}
{{- if and .Values.batches.enabled (not .Values.queue.enabled) }}
{{- fail "batches.enabled needs the async lane: set queue.enabled (each batch line runs as a job on the drainers; docs/batches.md)" }}
{{- end }}
{{- if and .Values.batches.enabled (not .Values.batches.store.bundled) (not .Values.batches.store.external.existingSecret) }}
{{- fail "batches.store.bundled is false: name the Secret holding your PostgreSQL URL in batches.store.external.existingSecret" }}
{{- end }}
{{- if and .Values.greyRelease.main (eq .Values.greyRelease.main (include "kvrelay.fullname" .)) }}
{{- fail "greyRelease.main names this release itself: set it, in the canary release, to the main release's name" }}
{{- end }}
{{- $g := .Values.gateway }}
{{- if and $g.enabled $g.grpc.enabled .Values.codec.grpcPort }}
{{- if not $g.grpc.hostnames }}
{{- fail "gateway.grpc.hostnames is empty: the GRPCRoute needs hostnames of its own (a Gateway accepts only one of an HTTPRoute and a GRPCRoute on one hostname), or set gateway.grpc.enabled false" }}
{{- end }}
{{- range $g.grpc.hostnames }}
{{- if has . $g.hostnames }}
{{- fail (printf "gateway.grpc.hostnames and gateway.hostnames both hold %s: a Gateway accepts only one of an HTTPRoute and a GRPCRoute on one hostname" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.codec.tls.enabled (not .Values.codec.tls.existingSecret) }}
{{- fail "codec.tls.enabled needs codec.tls.existingSecret: a kubernetes.io/tls Secret (tls.crt, tls.key) with the API's certificate, e.g. the one a cert-manager Certificate writes" }}
{{- end }}
{{- include "kvrelay.checkConfigKeys" . }}
{{- include "kvrelay.checkKvTiers" . }}
{{- end }}

{{/* Config keys the chart sets from other values (in the ConfigMap or the environment, where they would
     silently win over the same key under `config`): refused there, naming the value that sets each. */}}
{{- define "kvrelay.checkConfigKeys" -}}
{{- $cfg := default dict .Values.config }}
{{- $owned := dict
      "auth" (dict "keys_file" "auth.existingSecret and auth.key" "allow_open" "auth.allowOpen")
      "quotas" (dict "redis_url" "redis.enabled or redis.external")
      "responses" (dict "redis_url" "redis.enabled or redis.external" "key_prefix" "redis.responsesKeyPrefix" "compaction_keys_file" "responses.compactionKeys.existingSecret")
      "server" (dict "metrics_port" "codec.metricsPort" "tls" "codec.tls")
      "batches" (dict "store_url" "batches.store" "max_file_bytes" "batches.maxFileBytes" "max_lines" "batches.maxLines")
      "internal_tls" (dict "cert_file" "internalTls" "key_file" "internalTls" "ca_file" "internalTls") }}
{{- range $section, $keys := $owned }}
{{- range $key, $instead := $keys }}
{{- if hasKey (default dict (get $cfg $section)) $key }}
{{- fail (printf "config.%s.%s: the chart sets it; set %s instead" $section $key $instead) }}
{{- end }}
{{- end }}
{{- end }}
{{- with get $cfg "logging" }}
{{- fail (printf "config.logging (%s): the chart sets each container's log level; set logLevel, or codec.logLevel, router.logLevel, prefill.logLevel, decode.logLevel, paired.logLevel instead" (keys . | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
