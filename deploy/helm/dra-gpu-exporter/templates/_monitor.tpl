{{/* The scrape endpoint shared by the ServiceMonitor and the PodMonitor. */}}
{{- define "dge.scrapeEndpoint" -}}
{{- $proxy := .root.Values.kubeRbacProxy.enabled }}
{{- $tls := and .root.Values.webConfig.enabled .root.Values.webConfig.tls }}
port: {{ ternary "https" "metrics" $proxy }}
path: /metrics
scheme: {{ ternary "https" "http" (or $proxy $tls) }}
interval: {{ .cfg.interval }}
scrapeTimeout: {{ .cfg.scrapeTimeout }}
{{- if and $proxy .withToken }}
# kube-rbac-proxy checks Prometheus' own service-account token against the
# <release>-metrics-reader ClusterRole; its default certificate is self-signed.
bearerTokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
{{- end }}
{{- if or $proxy $tls }}
tlsConfig:
  insecureSkipVerify: true
{{- end }}
# The exporter's own namespace/pod/container/node labels describe the workload that holds a
# GPU; they must win over the target labels of the exporter pod.
honorLabels: true
relabelings:
  # `node` on Prometheus' own series for the target (up, scrape_duration_seconds), so the
  # dashboards can filter them like the exporter's series.
  - action: replace
    sourceLabels: [__meta_kubernetes_pod_node_name]
    targetLabel: node
  # Drop the exporter pod's identity from the target labels, so that `namespace` and `pod`
  # on every series always mean the GPU workload (instance and node still identify the agent).
  - action: labeldrop
    regex: "pod|namespace|container|service|endpoint"
{{- end -}}
