{{/*
Names, labels and the small computations every template shares.
docs/kubernetes.md describes what each object is for.
*/}}

{{/* The chart name (nameOverride). */}}
{{- define "narwhal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object's name: fullnameOverride, else the release name when it already
contains the chart name, else "<release>-<chart>". With release "narwhal" it is "narwhal".
*/}}
{{- define "narwhal.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* helm.sh/chart: name-version. */}}
{{- define "narwhal.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "narwhal.labels" -}}
helm.sh/chart: {{ include "narwhal.chart" . }}
{{ include "narwhal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: narwhal
{{- end -}}

{{/* The labels selectors use (never change them on an installed release). */}}
{{- define "narwhal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "narwhal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The image every Narwhal container runs: repository:tag, the tag defaulting to appVersion. */}}
{{- define "narwhal.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}

{{/* Object names. */}}
{{- define "narwhal.routerName" -}}
{{- printf "%s-router" (include "narwhal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "narwhal.controlServiceName" -}}
{{- printf "%s-control" (include "narwhal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "narwhal.selfDrainServiceName" -}}
{{- printf "%s-self-drain" (include "narwhal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "narwhal.agentName" -}}
{{- printf "%s-agent" (include "narwhal.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The router's service account: router.serviceAccount.name, else <fullname>-router. */}}
{{- define "narwhal.routerServiceAccount" -}}
{{- default (include "narwhal.routerName" .) .Values.router.serviceAccount.name -}}
{{- end -}}

{{/* The agent's service account: agent.serviceAccount.name, else <fullname>-agent. */}}
{{- define "narwhal.agentServiceAccount" -}}
{{- default (include "narwhal.agentName" .) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{/* The router Lease's name: router.lease.name, else <fullname>-router ("narwhal-router"). */}}
{{- define "narwhal.leaseName" -}}
{{- default (include "narwhal.routerName" .) .Values.router.lease.name -}}
{{- end -}}

{{/* http or https: the control listener's scheme (https with router.controlTLS). */}}
{{- define "narwhal.controlScheme" -}}
{{- if .Values.router.controlTLS.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/* The control Service's URL inside the cluster: what narwhalctl, engines and tests call. */}}
{{- define "narwhal.controlURL" -}}
{{- printf "%s://%s.%s.svc:%v" (include "narwhal.controlScheme" .) (include "narwhal.controlServiceName" .) .Release.Namespace .Values.router.ports.control -}}
{{- end -}}

{{/*
The self-drain Service's URL inside the cluster: what engine pods' preStop hooks call. The
listener speaks TLS with the control certificate when router.controlTLS is enabled.
*/}}
{{- define "narwhal.selfDrainURL" -}}
{{- printf "%s://%s.%s.svc:%v" (include "narwhal.controlScheme" .) (include "narwhal.selfDrainServiceName" .) .Release.Namespace .Values.selfDrain.port -}}
{{- end -}}

{{/*
The namespaces of the engine pods whose pods the routers may read (selfDrain.engineNamespaces,
else the release namespace). A JSON list, without duplicates.
*/}}
{{- define "narwhal.engineNamespaces" -}}
{{- toJson (uniq (default (list .Release.Namespace) .Values.selfDrain.engineNamespaces)) -}}
{{- end -}}

{{/*
The volume holding the CA of the self-drain listener's certificate (with router.controlTLS):
selfDrain.caSecretName, else router.controlTLS.secretName; only its key ca.crt is mounted.
Takes the root context and the volume's name: (dict "root" $ "name" NAME).
*/}}
{{- define "narwhal.selfDrainCAVolume" -}}
name: {{ .name }}
secret:
  secretName: {{ default .root.Values.router.controlTLS.secretName .root.Values.selfDrain.caSecretName }}
  items:
    - key: ca.crt
      path: ca.crt
  defaultMode: 0444
{{- end -}}

{{/*
The PodDisruptionBudget API: policy/v1 where the cluster serves it (Kubernetes >= 1.21), else
policy/v1beta1. Against a cluster (helm install/upgrade) the discovery answer decides, by
kind; `helm template` knows no kinds, so there the target version decides (--kube-version).
*/}}
{{- define "narwhal.pdbApiVersion" -}}
{{- if .Capabilities.APIVersions.Has "policy/v1/PodDisruptionBudget" -}}
policy/v1
{{- else if .Capabilities.APIVersions.Has "policy/v1beta1/PodDisruptionBudget" -}}
policy/v1beta1
{{- else if semverCompare ">=1.21.0-0" .Capabilities.KubeVersion.Version -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end -}}

{{/*
The router's fleet file: .Values.fleet with the lease forced to the kubernetes backend, the TLS
sections and recovery.state_path the chart's volumes provide, and control.self_drain from
selfDrain.* (api_server, token_file and ca_file left out: the pod's service-account mount and
KUBERNETES_SERVICE_HOST/PORT). Rendered as JSON.
*/}}
{{- define "narwhal.fleetDocument" -}}
{{- if hasKey .Values.fleet "lease" -}}
{{- fail "fleet.lease: the chart sets the lease (the kubernetes backend) from router.lease.*: remove fleet.lease and use router.lease.name, ttlSeconds, renewIntervalSeconds, safetyMarginSeconds" -}}
{{- end -}}
{{- $fleet := deepCopy .Values.fleet -}}
{{- $lease := dict "backend" "kubernetes"
      "ttl_s" .Values.router.lease.ttlSeconds
      "renew_interval_s" .Values.router.lease.renewIntervalSeconds
      "safety_margin_s" .Values.router.lease.safetyMarginSeconds
      "kubernetes" (dict "name" (include "narwhal.leaseName" .)) -}}
{{- $_ := set $fleet "lease" $lease -}}
{{- $recovery := default (dict) (get $fleet "recovery") -}}
{{- if not (hasKey $recovery "state_path") -}}
{{- $_ := set $recovery "state_path" "/var/lib/narwhal/state.json" -}}
{{- end -}}
{{- $_ := set $fleet "recovery" $recovery -}}
{{- if .Values.router.tls.enabled -}}
{{- $_ := set $fleet "tls" (dict "ca" "/etc/narwhal/tls/ca.crt" "cert" "/etc/narwhal/tls/tls.crt" "key" "/etc/narwhal/tls/tls.key") -}}
{{- end -}}
{{- $control := default (dict) (get $fleet "control") -}}
{{- if hasKey $control "self_drain" -}}
{{- fail "fleet.control.self_drain: the chart sets it from selfDrain.* (enabled, port, audience, deadlineSeconds, readmit): remove fleet.control.self_drain" -}}
{{- end -}}
{{- if .Values.router.controlTLS.enabled -}}
{{- $_ := set $control "tls" (dict "ca" "/etc/narwhal/control-tls/ca.crt" "cert" "/etc/narwhal/control-tls/tls.crt" "key" "/etc/narwhal/control-tls/tls.key") -}}
{{- end -}}
{{- if .Values.router.tokenizer.volume -}}
{{- $engine := default (dict) (get $fleet "engine") -}}
{{- if hasKey $engine "tokenizer" -}}
{{- fail "fleet.engine.tokenizer: the chart sets it from router.tokenizer.volume (mounted at /etc/narwhal/tokenizer): remove fleet.engine.tokenizer" -}}
{{- end -}}
{{- $_ := set $engine "tokenizer" (printf "/etc/narwhal/tokenizer/%s" .Values.router.tokenizer.subPath | trimSuffix "/") -}}
{{- $_ := set $fleet "engine" $engine -}}
{{- end -}}
{{- if .Values.selfDrain.enabled -}}
{{- $sd := .Values.selfDrain -}}
{{- $_ := set $control "self_drain" (dict "listen" (printf "0.0.0.0:%d" (int $sd.port)) "audience" $sd.audience "deadline_s" (int $sd.deadlineSeconds) "readmit" $sd.readmit) -}}
{{- end -}}
{{- if $control -}}
{{- $_ := set $fleet "control" $control -}}
{{- end -}}
{{- toPrettyJson $fleet -}}
{{- end -}}

{{/* serving.graceful_timeout_s of the fleet (30 when unset): how long the router drains. */}}
{{- define "narwhal.gracefulTimeout" -}}
{{- $serving := default (dict) (get .Values.fleet "serving") -}}
{{- if hasKey $serving "graceful_timeout_s" -}}{{ int (get $serving "graceful_timeout_s") }}{{- else -}}30{{- end -}}
{{- end -}}

{{/*
The agent's configuration for one node: engines from agent.nodes.<node>.engines, else
agent.engines, plus the example engines placed on that node. `node` is "" for the default
config every node without its own entry uses. __NODE_NAME__ is replaced with the node's name
when the pod starts (it is the agent_id). Takes (dict "root" $ "node" NAME).
*/}}
{{- define "narwhal.agentConfig" -}}
{{- $root := .root -}}
{{- $a := $root.Values.agent -}}
{{- $nodeCfg := dict -}}
{{- if and .node (hasKey $a.nodes .node) -}}{{- $nodeCfg = get $a.nodes .node -}}{{- end -}}
{{- $engines := list -}}
{{- if hasKey $nodeCfg "engines" -}}
{{- $engines = concat $engines (get $nodeCfg "engines") -}}
{{- else -}}
{{- $engines = concat $engines $a.engines -}}
{{- end -}}
{{- if and .node $root.Values.engines.example.enabled -}}
{{- range $root.Values.engines.example.instances -}}
{{- if eq (toString .node) $.node -}}
{{- $engines = append $engines (dict "iid" .iid "url" (printf "http://127.0.0.1:%v" .port) "dialect" (default $root.Values.engines.example.dialect .dialect) "process" (dict "listen_port" .port)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $doc := dict
      "schema" "narwhal.agent-config"
      "schema_version" 1
      "agent_id" "__NODE_NAME__"
      "listen" (printf "0.0.0.0:%v" $a.port)
      "tls" (dict "ca" "/etc/narwhal-agent/tls/ca.crt" "cert" "/etc/narwhal-agent/tls/tls.crt" "key" "/etc/narwhal-agent/tls/tls.key")
      "signing_key" (printf "%s/agent.ed25519.pk8" $a.hostStateDir)
      "state_dir" $a.hostStateDir
      "timeouts" $a.timeouts
      "engines" $engines -}}
{{- toPrettyJson $doc -}}
{{- end -}}

{{/*
The nodes that get a configuration of their own: agent.nodes' keys, and (with the example
engines) every node an example instance is placed on. A list, sorted.
*/}}
{{- define "narwhal.agentNodes" -}}
{{- $nodes := keys .Values.agent.nodes -}}
{{- if .Values.engines.example.enabled -}}
{{- range .Values.engines.example.instances -}}
{{- $nodes = append $nodes (toString .node) -}}
{{- end -}}
{{- end -}}
{{- toJson (sortAlpha (uniq $nodes)) -}}
{{- end -}}

{{/* The router containers' mounts (check-config sees exactly what the run sees). */}}
{{- define "narwhal.routerMounts" -}}
- name: fleet
  mountPath: /etc/narwhal/fleet
  readOnly: true
- name: state
  mountPath: /var/lib/narwhal
{{- if .Values.router.tls.enabled }}
- name: tls
  mountPath: /etc/narwhal/tls
  readOnly: true
{{- end }}
{{- if .Values.router.controlTLS.enabled }}
- name: control-tls
  mountPath: /etc/narwhal/control-tls
  readOnly: true
{{- end }}
{{- if .Values.router.tokenizer.volume }}
- name: tokenizer
  mountPath: /etc/narwhal/tokenizer
  readOnly: true
{{- end }}
{{- end -}}

{{/* The agent containers' mounts. The state path is the same inside and on the host. */}}
{{- define "narwhal.agentMounts" -}}
- name: config
  mountPath: /run/narwhal-agent
- name: tls
  mountPath: /etc/narwhal-agent/tls
  readOnly: true
- name: state
  mountPath: {{ .Values.agent.hostStateDir }}
{{- end -}}
