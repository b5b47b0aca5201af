{{/*
The namespace of every object: kube-system, whatever the release's namespace. The agent's
pods use priorityClassName system-node-critical, like kube-proxy, and many clusters (GKE and
other managed offerings among them) allow the system-* priority classes only in namespaces
with a matching ResourceQuota, which kube-system has. A dedicated namespace would need such
a quota too, so everything lives in kube-system and no Namespace object is shipped. The
namespace is written out (not taken from --namespace) so that a release installed without
--namespace kube-system still lands there, and so that the kustomization renders the same
objects.
*/}}
{{- define "ebpf-proxy.namespace" -}}
kube-system
{{- end }}

{{/*
Labels of every object: app.kubernetes.io/name, commonLabels, and the labels of the dict
given as "extra" (`include "ebpf-proxy.labels" (dict "root" . "extra" $labels)`); called
with the root context alone, no extra labels. One map, so a label given twice is written
once (the schema keeps app.kubernetes.io/name the chart's).
*/}}
{{- define "ebpf-proxy.labels" -}}
{{- $root := .root | default . }}
{{- $extra := .extra | default dict }}
{{- toYaml (merge (dict "app.kubernetes.io/name" "ebpf-proxy") (deepCopy $extra) $root.Values.commonLabels) }}
{{- end }}

{{/* The DaemonSet's selector (immutable: never change it). */}}
{{- define "ebpf-proxy.selectorLabels" -}}
app.kubernetes.io/name: ebpf-proxy
{{- end }}

{{/* The image reference: repository, then the digest, else the tag, else appVersion. */}}
{{- define "ebpf-proxy.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}
{{- end }}

{{/* The port of metrics.bindAddress (ip:port or [ip]:port). */}}
{{- define "ebpf-proxy.metricsPort" -}}
{{ regexReplaceAll "^.*:" .Values.metrics.bindAddress "" }}
{{- end }}

{{/* The API server's address; rendering fails when it is not set. */}}
{{- define "ebpf-proxy.apiServerAddress" -}}
{{- required "apiServer.address is required: the API server's own address or its load balancer's (host:port or https://host:port), never the kubernetes Service's ClusterIP, which nothing translates on a node without a running proxy. E.g. --set apiServer.address=192.0.2.10:6443; `kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}'` prints the one kubectl uses" .Values.apiServer.address }}
{{- end }}

{{/* The kube-proxy configuration file, with apiVersion and kind filled in. */}}
{{- define "ebpf-proxy.kubeProxyConfig" -}}
{{- $defaults := dict "apiVersion" "kubeproxy.config.k8s.io/v1alpha1" "kind" "KubeProxyConfiguration" }}
{{- toYaml (merge (deepCopy .Values.kubeProxyConfig) $defaults) }}
{{- end }}
