{{/* Internal mutual TLS (internalTls): one certificate, from a Secret with tls.crt, tls.key and ca.crt, mounted
     into the codec, the router and every worker container and named to them as internal_tls.* through
     the environment (services/common/grpc_tls.py). */}}

{{- define "kvrelay.internalTlsDir" -}}/etc/kvrelay/internal-tls{{- end }}

{{/* The Secret: internalTls.existingSecret, else the one the cert-manager Certificate writes. */}}
{{- define "kvrelay.internalTlsSecretName" -}}
{{- default (include "kvrelay.componentName" (dict "root" . "component" "internal-tls")) .Values.internalTls.existingSecret }}
{{- end }}

{{- define "kvrelay.internalTlsEnv" -}}
{{- if .Values.internalTls.enabled }}
{{- $dir := include "kvrelay.internalTlsDir" . }}
- name: KVRELAY_INTERNAL_TLS__CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: KVRELAY_INTERNAL_TLS__KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
- name: KVRELAY_INTERNAL_TLS__CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
{{- with .Values.internalTls.serverName }}
- name: KVRELAY_INTERNAL_TLS__SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The DNS names of every internal Service a kvrelay process or the codec dials: the router, the worker
     Services, the bundled Redis, the KV tiers' cache Redis; each short, with its namespace, and fully
     qualified. */}}
{{- define "kvrelay.internalDnsNames" -}}
{{- $components := list "router" }}
{{- range $stage := list "prefill" "decode" }}
{{- if (index $.Values $stage).enabled }}{{- $components = append $components $stage }}{{- end }}
{{- end }}
{{- if .Values.paired.enabled }}{{- $components = concat $components (list "paired-prefill" "paired-decode") }}{{- end }}
{{- if .Values.redis.enabled }}{{- $components = append $components "redis" }}{{- end }}
{{- if include "kvrelay.kvCacheBundled" . }}{{- $components = append $components "kv-cache" }}{{- end }}
{{- $names := list }}
{{- range $components }}
{{- $service := include "kvrelay.componentName" (dict "root" $ "component" .) }}
{{- $names = concat $names (list $service (printf "%s.%s" $service $.Release.Namespace) (printf "%s.%s.svc" $service $.Release.Namespace) (printf "%s.%s.svc.%s" $service $.Release.Namespace $.Values.internalTls.certManager.clusterDomain)) }}
{{- end }}
{{- with .Values.internalTls.serverName }}{{- $names = append $names . }}{{- end }}
{{- toYaml (append $names "localhost") }}
{{- end }}

{{/* A gRPC health probe's handler: Kubernetes' native grpc probe, which speaks plaintext; with internal TLS
     the same grpc.health.v1 Check run in the container, presenting the pod's certificate (the image's
     Python and services.common.probes). Call with (dict "root" $ "port" PORT "service" HEALTH_SERVICE). */}}
{{- define "kvrelay.grpcProbe" -}}
{{- if .root.Values.internalTls.enabled }}
exec:
  command:
    - python
    - -c
    - >-
      import sys; from services.common.probes import GrpcHealthCheck; from services.common.config import load_config;
      check = GrpcHealthCheck(sys.argv[1], timeout_s=2.0, service=sys.argv[2], tls=load_config().internal_tls);
      sys.exit(0 if check.is_healthy() else 1)
    - {{ printf "127.0.0.1:%v" .port | quote }}
    - {{ .service | quote }}
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .service | quote }}
{{- end }}
{{- end }}
