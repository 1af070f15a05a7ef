{{/* The entry: ingress-nginx canary annotations and the Gateway API routes' pieces (ingress.yaml, gateway.yaml). */}}

{{/* ingress-nginx's canary annotations for ingress.canary (header, then cookie, then weight); nothing unless
     it is enabled. Call with the canary values (a cookie left out: no cookie split). */}}
{{- define "kvrelay.canaryAnnotations" -}}
{{- if .enabled }}
nginx.ingress.kubernetes.io/canary: "true"
nginx.ingress.kubernetes.io/canary-weight: {{ .weight | quote }}
{{- with .header }}
nginx.ingress.kubernetes.io/canary-by-header: {{ . | quote }}
{{- end }}
{{- if and .header .headerValue }}
nginx.ingress.kubernetes.io/canary-by-header-value: {{ .headerValue | quote }}
{{- end }}
{{- with .cookie }}
nginx.ingress.kubernetes.io/canary-by-cookie: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* An Ingress's annotations: `annotations`, then ingress.extraAnnotations, then, with codec.tls, how
     ingress-nginx reaches the TLS codec (ingress.backendTls): backend-protocol `protocol` (HTTPS or GRPCS)
     when it re-encrypts, ssl-passthrough when it passes the client's TLS through. */}}
{{- define "kvrelay.ingressAnnotations" -}}
{{- $notes := merge (deepCopy (default dict .root.Values.ingress.extraAnnotations)) (deepCopy (default dict .annotations)) }}
{{- if .root.Values.codec.tls.enabled }}
{{- if eq .root.Values.ingress.backendTls "passthrough" }}
{{- $_ := set $notes "nginx.ingress.kubernetes.io/ssl-passthrough" "true" }}
{{- $_ := unset $notes "nginx.ingress.kubernetes.io/backend-protocol" }}
{{- else }}
{{- $_ := set $notes "nginx.ingress.kubernetes.io/backend-protocol" .protocol }}
{{- end }}
{{- end }}
{{- if $notes }}
{{- toYaml $notes }}
{{- end }}
{{- end }}

{{/* The cookie split as a header match (the Gateway API has none for cookies): the Cookie header holding
     name=value among its pairs. RE2 syntax, as Envoy- and nginx-based Gateways take it. */}}
{{- define "kvrelay.cookieRegex" -}}
{{- printf "^(.*;\\s*)?%s=%s(;.*)?$" (regexQuoteMeta .name) (regexQuoteMeta .value) }}
{{- end }}

{{/* One route's backendRefs: the main codec's Service, and the canary's with weights when `canary` names
     one. Call with (dict "root" $ "port" PORT "weight" PERCENT): 0, the main one alone; 100, the canary
     alone. */}}
{{- define "kvrelay.routeBackends" -}}
{{- $main := include "kvrelay.componentName" (dict "root" .root "component" "codec") }}
{{- $release := .root.Values.gateway.canary.release }}
{{- if or (le (int .weight) 0) (not $release) }}
- name: {{ $main }}
  port: {{ .port }}
{{- else if ge (int .weight) 100 }}
- name: {{ printf "%s-codec" $release | trunc 63 | trimSuffix "-" }}
  port: {{ .port }}
{{- else }}
- name: {{ $main }}
  port: {{ .port }}
  weight: {{ sub 100 (int .weight) }}
- name: {{ printf "%s-codec" $release | trunc 63 | trimSuffix "-" }}
  port: {{ .port }}
  weight: {{ int .weight }}
{{- end }}
{{- end }}
