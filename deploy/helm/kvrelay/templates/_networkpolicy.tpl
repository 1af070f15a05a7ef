{{/* NetworkPolicy pieces shared by networkpolicy.yaml. */}}

{{/* A peer selecting one component's pods of this release. Call with (dict "root" $ "component" NAME). */}}
{{- define "kvrelay.podPeer" -}}
- podSelector:
    matchLabels:
      {{- include "kvrelay.selectorLabels" . | nindent 6 }}
{{- end }}

{{/* A peer selecting one stateful component's pods (bundled Redis, queue, batch store) of the release whose
     state this one uses (greyRelease.main, else this release). Call with (dict "root" $ "component" NAME). */}}
{{- define "kvrelay.statePeer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "kvrelay.name" .root }}
      app.kubernetes.io/instance: {{ default .root.Release.Name .root.Values.greyRelease.main }}
      app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every codec and drainer pod that uses this release's state, a canary's (greyRelease.main) included: they
     carry kvrelay.dev/state: <the state's release>; and this release's own by their instance, as before that
     label (pods of an older chart, while an upgrade rolls). */}}
{{- define "kvrelay.stateClientPeers" -}}
{{- include "kvrelay.codecPeers" . }}
{{- range $component := list "codec" "drainer" }}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "kvrelay.name" $ }}
      app.kubernetes.io/component: {{ $component }}
      kvrelay.dev/state: {{ include "kvrelay.stateRelease" $ }}
{{- end }}
{{- end }}

{{/* The pods that run the codec: the codec's, and the drainers' (the same pod with --drain) when the async
     lane is on. */}}
{{- define "kvrelay.codecPeers" -}}
{{- include "kvrelay.podPeer" (dict "root" . "component" "codec") }}
{{- if .Values.queue.enabled }}
{{ include "kvrelay.podPeer" (dict "root" . "component" "drainer") }}
{{- end }}
{{- end }}

{{- define "kvrelay.policyTypes" -}}
{{- if .Values.networkPolicy.egress.enabled }}[Ingress, Egress]{{ else }}[Ingress]{{ end }}
{{- end }}

{{/* The OTLP endpoint's port (config.tracing.otlp_endpoint), empty when tracing is off; gRPC's 443 when the
     URL names none. */}}
{{- define "kvrelay.otlpPort" -}}
{{- $endpoint := toString (dig "tracing" "otlp_endpoint" "" (default dict .Values.config)) | trim }}
{{- if $endpoint }}
{{- $host := (urlParse $endpoint).host }}
{{- default "443" (trimPrefix ":" (regexFind ":[0-9]+$" $host)) }}
{{- end }}
{{- end }}

{{/* Egress every kvrelay pod gets: DNS, the OTLP endpoint when tracing is on, and networkPolicy.extraEgress's
     `all` and `kind` rules. Call with (dict "root" $ "kind" "codec"|"router"|"workers"). */}}
{{- define "kvrelay.commonEgress" -}}
{{- $np := .root.Values.networkPolicy }}
- to:
    {{- toYaml $np.egress.dns.to | nindent 4 }}
  ports:
    - port: {{ $np.egress.dns.port }}
      protocol: UDP
    - port: {{ $np.egress.dns.port }}
      protocol: TCP
{{- with include "kvrelay.otlpPort" .root }}
- ports:
    - port: {{ int . }}
      protocol: TCP
  {{- with $np.egress.otlpTo }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- with $np.extraEgress.all }}
{{ toYaml . }}
{{- end }}
{{- with index $np.extraEgress .kind }}
{{ toYaml . }}
{{- end }}
{{- end }}
