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
{{- $a := required "apiServer.address is required: the API server's own address or its load balancer's (host:port or https://host:port), never the kubernetes Service's ClusterIP, which nothing translates on a node without a running proxy. E.g. --set apiServer.address=192.0.2.10:6443; `kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}'` prints the one kubectl uses" .Values.apiServer.address }}
{{- $host := `(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)` }}
{{- if not (regexMatch (printf `^(https://%s(:[0-9]+)?/?|%s:[0-9]+)$` $host $host) $a) }}
{{- fail (printf "apiServer.address %q is not host:port or https://host[:port] (a DNS name or an IP address, IPv6 in brackets), e.g. 192.0.2.10:6443 or https://[2001:db8::10]:6443" $a) }}
{{- end }}
{{- $port := regexFind `:[0-9]+/?$` (trimPrefix "https://" $a) | trimPrefix ":" | trimSuffix "/" }}
{{- if and $port (or (eq (atoi $port) 0) (gt (atoi $port) 65535)) }}
{{- fail (printf "apiServer.address %q: port %s is not a port from 1 to 65535" $a $port) }}
{{- end }}
{{- $a }}
{{- end }}

{{/* The kube-proxy configuration file, with apiVersion and kind filled in. */}}
{{- define "ebpf-proxy.kubeProxyConfig" -}}
{{- $defaults := dict "apiVersion" "kubeproxy.config.k8s.io/v1alpha1" "kind" "KubeProxyConfiguration" }}
{{- toYaml (merge (deepCopy .Values.kubeProxyConfig) $defaults) }}
{{- end }}

{{/*
Values added to the chart after the kube-proxy cleanup Job, read with their values.yaml
defaults when absent. `helm upgrade --reuse-values` (the rollback's command) renders with
the previous release's values in place of this chart's values.yaml, so a release
installed from an older chart has none of them, and `.Values.agent.enabled` would fail
on the missing map. proxy-userspace/tests/deploy_manifests.rs checks that a render
without these keys equals the render with values.yaml's.
*/}}
{{/* agent.enabled: "true" or empty, for `if`. */}}
{{- define "ebpf-proxy.agentEnabled" -}}
{{- if dig "enabled" true (.Values.agent | default dict) }}true{{ end }}
{{- end }}

{{/* dataPathCleanup, every key present, as YAML (`include ... | fromYaml`). */}}
{{- define "ebpf-proxy.dataPathCleanup" -}}
{{- $v := .Values.dataPathCleanup | default dict }}
{{- toYaml (dict
  "enabled" (dig "enabled" false $v)
  "nodes" (dig "nodes" 0 $v)
  "waitForKubeProxy" (dig "waitForKubeProxy" "10m" $v)
  "backoffLimitPerNode" (dig "backoffLimitPerNode" 6 $v)
  "ttlSecondsAfterFinished" (dig "ttlSecondsAfterFinished" 3600 $v)) }}
{{- end }}

{{/*
A one-off Job that runs `/usr/local/bin/ebpf-proxy ARGS` once on each of the agents'
nodes, all at once, with the agent's image: the kube-proxy cleanup Job (kubeProxyCleanup,
templates/kube-proxy-cleanup-job.yaml) and the data path cleanup Job (dataPathCleanup,
templates/data-path-cleanup-job.yaml). Both change the node itself, so both run
privileged in the host's network and PID namespaces, on the agents' nodes (their
nodeSelector and tolerations), at most one pod per node. Called with a dict:

  root       the chart's root context
  key        the key of the Job's values, for messages
  values     those values: nodes, backoffLimitPerNode, ttlSecondsAfterFinished
  component  the Job's app.kubernetes.io/component; the Job is named
             ebpf-proxy-<component>-<hash> and its pods are labelled
             app.kubernetes.io/name: ebpf-proxy-<component>
  container  the name of a define rendering the container's `args` and `volumeMounts`
             (with comments saying why)
  volumes    the name of a define rendering the pod's volumes (a YAML list)

Rendering fails when <key>.nodes is below 1. The Job's name ends in a hash of its spec: a
Job's pod template cannot be changed, so an upgrade that changes it (a new image, another
node count, other arguments) replaces the Job instead of failing; the new Job runs the
command again on every node, which both commands allow (a second run finds nothing to
remove).
*/}}
{{- define "ebpf-proxy.nodeJob" -}}
{{- $root := .root }}
{{- $values := .values }}
{{- $nodes := int $values.nodes }}
{{- if lt $nodes 1 }}
{{- fail (printf "%s.nodes is required with %s.enabled: the number of nodes the agents run (or ran) on, e.g. --set %s.nodes=$(kubectl get nodes -l kubernetes.io/os=linux --no-headers | wc -l)" .key .key .key) }}
{{- end }}
{{- $podName := printf "ebpf-proxy-%s" .component }}
{{- $spec := include "ebpf-proxy.nodeJobSpec" (dict "root" $root "key" .key "podName" $podName "nodes" $nodes "values" $values "container" .container "volumes" .volumes) -}}
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ $podName }}-{{ $spec | sha256sum | trunc 8 }}
  namespace: {{ include "ebpf-proxy.namespace" $root }}
  labels:
    {{- include "ebpf-proxy.labels" (dict "root" $root "extra" (dict "app.kubernetes.io/component" .component)) | nindent 4 }}
spec:
  {{- $spec | nindent 2 }}
{{- end }}

{{/* The spec of ebpf-proxy.nodeJob's Job (whose name carries its hash). */}}
{{- define "ebpf-proxy.nodeJobSpec" -}}
{{- $root := .root -}}
# One pod per node, all at once: index i of `nodes` completions. Indexed, so that the Job
# counts completions per index and never starts more than `nodes` pods.
completionMode: Indexed
completions: {{ .nodes }}
parallelism: {{ .nodes }}
# Container restarts allowed in all ({{ .key }}.backoffLimitPerNode per node,
# shared by all the pods): a pod whose node is not ready for the command fails and
# retries in place (restartPolicy OnFailure) with an exponential delay.
backoffLimit: {{ mul .nodes (int .values.backoffLimitPerNode) }}
ttlSecondsAfterFinished: {{ int .values.ttlSecondsAfterFinished }}
template:
  metadata:
    labels:
      # Not app.kubernetes.io/name: ebpf-proxy, which selects the agents (the DaemonSet,
      # the metrics Service).
      {{- $podLabels := dict "app.kubernetes.io/name" .podName "app.kubernetes.io/part-of" "ebpf-proxy" }}
      {{- toYaml (merge $podLabels $root.Values.commonLabels) | nindent 6 }}
  spec:
    restartPolicy: OnFailure
    # The host's network namespace: the node's iptables and nftables rules, the
    # interfaces the tc programs are attached to, the agent's status server on
    # 127.0.0.1:10266.
    hostNetwork: true
    # The host's processes: the kube-proxy cleanup refuses while kube-proxy runs on the
    # node, which it sees there.
    hostPID: true
    dnsPolicy: Default
    # No API access is needed.
    automountServiceAccountToken: false
    {{- with $root.Values.priorityClassName }}
    priorityClassName: {{ . | quote }}
    {{- end }}
    {{- with $root.Values.nodeSelector }}
    # The agents' nodes: where ebpf-proxy and kube-proxy trade places.
    nodeSelector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $root.Values.tolerations }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $root.Values.imagePullSecrets }}
    imagePullSecrets:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    # At most one pod of this Job per node. The scheduler counts only unfinished pods
    # here, so this spreads the pods that run at the same time; they all start together.
    affinity:
      podAntiAffinity:
        requiredDuringSchedulingIgnoredDuringExecution:
          - labelSelector:
              matchLabels:
                app.kubernetes.io/name: {{ .podName }}
            topologyKey: kubernetes.io/hostname
    containers:
      - name: cleanup
        image: {{ include "ebpf-proxy.image" $root | quote }}
        imagePullPolicy: {{ $root.Values.image.pullPolicy }}
        command: ["/usr/local/bin/ebpf-proxy"]
        {{- include .container $root | nindent 8 }}
        # Privileged: it changes the node's kernel state (netfilter rules, BPF programs
        # and pins), once. Nothing stays running.
        securityContext:
          privileged: true
        terminationMessagePolicy: FallbackToLogsOnError
        resources:
          requests:
            cpu: 10m
            memory: 32Mi
    volumes:
      {{- include .volumes $root | nindent 6 }}
{{- end }}
