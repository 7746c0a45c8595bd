{{/*
narwhal.enginePod: the pod template of an engine (vLLM or SGLang) that leaves the fleet through
the router before it stops (docs/kubernetes.md, "Engine pods" and "Self-drain"). Use it as the
`template:` of your own engine StatefulSet, behind a headless Service, so that each pod has a DNS
name the fleet file can name the engine by (the router resolves it to the pod's address, which is
how it knows which engine a pod's token may drain):

  spec:
    serviceName: engines            # a headless Service (clusterIP: None,
                                    # publishNotReadyAddresses: true) selecting these pods
    replicas: 1
    selector:
      matchLabels: {narwhal.dev/iid: e0, ...}
    template:
      {{- include "narwhal.enginePod" (dict "root" $ "iid" "e0" "role" "prefill"
            "container" $engineContainer "pod" (dict "nodeSelector" ...)) | nindent 6 }}

and in the fleet file: url: http://<statefulset>-<ordinal>.engines.<namespace>.svc:<port>.

Arguments (a dict):
  root       the chart's root context ($), required
  role       prefill | decode | aggregated: the label narwhal.dev/role (PodDisruptionBudgets
             select by it), required
  container  the engine container (a dict in the Pod API's shape), required; it must not set
             lifecycle.preStop (the helper sets it), nor readinessProbe while readinessFromRouter
             is true (the helper sets that too), and it should list the engine's port in `ports`
             (the router drains for a pod only engines at one of its container ports)
  iid        the engine's iid in the fleet file, optional: only the label narwhal.dev/iid (the
             router finds the pod's engine by its address; a StatefulSet of several engines
             leaves it out)
  pod        more pod spec fields (nodeSelector, tolerations, affinity, volumes, more
             initContainers or containers, serviceAccountName, ...), optional
  labels     more pod labels, optional
  drainBudgetSeconds  overrides engines.drainBudgetSeconds, optional
  hostNetwork         overrides engines.hostNetwork, optional
  readinessFromRouter overrides engines.readinessFromRouter, optional

What it adds:
  - labels narwhal.dev/role, narwhal.dev/iid (when given) and the chart's selector labels with
    app.kubernetes.io/component: engine;
  - an init container that copies narwhal-prestop from the Narwhal image into a shared volume
    mounted at /narwhal/bin (the engine's image does not have it; it needs glibc 2.34 or newer,
    as Debian bookworm's or Ubuntu 22.04's);
  - a projected service-account token for the audience selfDrain.audience (one hour, renewed by
    the kubelet) at /var/run/secrets/narwhal/token, and with router.controlTLS the CA of the
    router's certificate at /narwhal/self-drain-ca/ca.crt;
  - the engine container's preStop hook: `narwhal-prestop --router <self-drain Service>
    --token-file /var/run/secrets/narwhal/token --budget-s B`: the router checks the token
    (TokenReview) and the live pod, stops placing on the pod's engine, the engine's resident
    requests finish, and the hook returns once the router reports it ready_to_stop (or B seconds
    passed, or the router refused, or no router answered within engines.connectTimeoutSeconds);
    then the kubelet sends SIGTERM. With selfDrain.readmit the router readmits the restarted
    engine through the six checks by itself;
  - with engines.readinessFromRouter (default true), the engine container's readiness probe:
    `narwhal-prestop --ready --router <the same URL> --token-file /var/run/secrets/narwhal/token
    --connect-timeout-s C` (timing from engines.readiness): the pod turns Ready only once the
    router places on every engine of the pod (each readmitted through the six checks after a
    restart), so a rollout or an eviction under a PodDisruptionBudget waits for the router
    before it takes the next pod down. While no router answers, the pods are NotReady;
  - terminationGracePeriodSeconds = B + engines.engineShutdownSeconds + engines.marginSeconds,
    so the kubelet never cuts the drain short;
  - automountServiceAccountToken: false unless `pod` sets it (the engine needs no API token);
  - hostNetwork (default true): the agent finds an engine by its listening port only in the
    host's network namespace (docs/agent.md, "Limits").
*/}}
{{- define "narwhal.enginePod" -}}
{{- $root := required "narwhal.enginePod: root ($) is required" .root -}}
{{- $role := required "narwhal.enginePod: role is required" .role -}}
{{- $iid := default "" .iid -}}
{{- $what := printf "narwhal.enginePod%s" (ternary (printf " %s" $iid) "" (ne $iid "")) -}}
{{- if not (has $role (list "prefill" "decode" "aggregated")) -}}
{{- fail (printf "%s: role %q: expected prefill, decode or aggregated" $what $role) -}}
{{- end -}}
{{- $sd := $root.Values.selfDrain -}}
{{- if not $sd.enabled -}}
{{- fail (printf "%s: selfDrain.enabled is false: engine pods drain through the router's self-drain listener (control.self_drain)" $what) -}}
{{- end -}}
{{- $e := $root.Values.engines -}}
{{- $budget := int $e.drainBudgetSeconds -}}
{{- if hasKey . "drainBudgetSeconds" -}}{{- $budget = int .drainBudgetSeconds -}}{{- end -}}
{{- if lt $budget (int $sd.deadlineSeconds) -}}
{{- fail (printf "%s: the drain budget (engines.drainBudgetSeconds, %d) must be at least selfDrain.deadlineSeconds (%d)" $what $budget (int $sd.deadlineSeconds)) -}}
{{- end -}}
{{- $hostNetwork := $e.hostNetwork -}}
{{- if hasKey . "hostNetwork" -}}{{- $hostNetwork = .hostNetwork -}}{{- end -}}
{{- $fromRouter := $e.readinessFromRouter -}}
{{- if hasKey . "readinessFromRouter" -}}{{- $fromRouter = .readinessFromRouter -}}{{- end -}}
{{- $tls := $root.Values.router.controlTLS.enabled -}}
{{- $url := default (include "narwhal.selfDrainURL" $root) $e.selfDrainURL -}}
{{- $container := deepCopy (required "narwhal.enginePod: container is required" .container) -}}
{{- if not (hasKey $container "name") -}}{{- $_ := set $container "name" "engine" -}}{{- end -}}
{{- $lifecycle := default (dict) (get $container "lifecycle") -}}
{{- if hasKey $lifecycle "preStop" -}}
{{- fail (printf "%s: the container sets lifecycle.preStop; the helper's preStop drains the engine through the router" $what) -}}
{{- end -}}
{{- if and $fromRouter (hasKey $container "readinessProbe") -}}
{{- fail (printf "%s: the container sets readinessProbe; with engines.readinessFromRouter the helper's readiness probe (narwhal-prestop --ready) asks the router whether it places on the pod's engines: drop the container's probe, or set engines.readinessFromRouter: false (or the helper's readinessFromRouter argument) to keep it" $what) -}}
{{- end -}}
{{- $router := list "--router" $url "--token-file" "/var/run/secrets/narwhal/token" -}}
{{- if $tls -}}
{{- $router = concat $router (list "--ca" "/narwhal/self-drain-ca/ca.crt") -}}
{{- end -}}
{{- $cmd := concat (list "/narwhal/bin/narwhal-prestop") $router (list "--budget-s" (toString $budget) "--connect-timeout-s" (toString (int $e.connectTimeoutSeconds))) -}}
{{- $_ := set $lifecycle "preStop" (dict "exec" (dict "command" $cmd)) -}}
{{- $_ := set $container "lifecycle" $lifecycle -}}
{{- if $fromRouter -}}
{{- $r := $e.readiness -}}
{{- if ge (int $r.connectTimeoutSeconds) (int $r.timeoutSeconds) -}}
{{- fail (printf "%s: engines.readiness.connectTimeoutSeconds (%d) must be below engines.readiness.timeoutSeconds (%d): the kubelet would kill the probe before it reports" $what (int $r.connectTimeoutSeconds) (int $r.timeoutSeconds)) -}}
{{- end -}}
{{- $ready := concat (list "/narwhal/bin/narwhal-prestop" "--ready") $router (list "--connect-timeout-s" (toString (int $r.connectTimeoutSeconds))) -}}
{{- $_ := set $container "readinessProbe" (dict "exec" (dict "command" $ready) "initialDelaySeconds" 0 "periodSeconds" (int $r.periodSeconds) "timeoutSeconds" (int $r.timeoutSeconds) "failureThreshold" (int $r.failureThreshold)) -}}
{{- end -}}
{{- $mounts := default (list) (get $container "volumeMounts") -}}
{{- $mounts = append $mounts (dict "name" "narwhal-bin" "mountPath" "/narwhal/bin" "readOnly" true) -}}
{{- $mounts = append $mounts (dict "name" "narwhal-token" "mountPath" "/var/run/secrets/narwhal" "readOnly" true) -}}
{{- if $tls -}}
{{- $mounts = append $mounts (dict "name" "narwhal-self-drain-ca" "mountPath" "/narwhal/self-drain-ca" "readOnly" true) -}}
{{- end -}}
{{- $_ := set $container "volumeMounts" $mounts -}}
{{- $pod := deepCopy (default (dict) .pod) -}}
{{- if not (hasKey $pod "automountServiceAccountToken") -}}
{{- $_ := set $pod "automountServiceAccountToken" false -}}
{{- end -}}
{{- $volumes := default (list) (get $pod "volumes") -}}
{{- $volumes = append $volumes (dict "name" "narwhal-bin" "emptyDir" (dict "sizeLimit" "64Mi")) -}}
{{- $token := dict "audience" $sd.audience "expirationSeconds" 3600 "path" "token" -}}
{{- $volumes = append $volumes (dict "name" "narwhal-token" "projected" (dict "sources" (list (dict "serviceAccountToken" $token)))) -}}
{{- if $tls -}}
{{- $volumes = append $volumes (include "narwhal.selfDrainCAVolume" (dict "root" $root "name" "narwhal-self-drain-ca") | fromYaml) -}}
{{- end -}}
{{- $_ := unset $pod "volumes" -}}
{{- $init := default (list) (get $pod "initContainers") -}}
{{- $_ := unset $pod "initContainers" -}}
{{- $sidecars := default (list) (get $pod "containers") -}}
{{- $_ := unset $pod "containers" -}}
{{- $grace := add $budget (int $e.engineShutdownSeconds) (int $e.marginSeconds) -}}
metadata:
  labels:
    {{- include "narwhal.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: engine
    app.kubernetes.io/part-of: narwhal
    narwhal.dev/role: {{ $role }}
    {{- if $iid }}
    narwhal.dev/iid: {{ $iid | quote }}
    {{- end }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  # narwhal-prestop's budget (engines.drainBudgetSeconds), then the engine's own shutdown
  # (engines.engineShutdownSeconds), plus engines.marginSeconds.
  terminationGracePeriodSeconds: {{ $grace }}
  {{- if $hostNetwork }}
  hostNetwork: true
  dnsPolicy: ClusterFirstWithHostNet
  {{- end }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  initContainers:
    # narwhal-prestop for the preStop hook, from the Narwhal image.
    - name: narwhal-prestop
      image: {{ include "narwhal.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["cp", "/usr/bin/narwhal-prestop", "/narwhal/bin/narwhal-prestop"]
      securityContext:
        {{- toYaml (merge (dict "runAsNonRoot" true "runAsUser" 10001 "runAsGroup" 10001) (deepCopy $root.Values.router.securityContext)) | nindent 8 }}
      resources:
        {{- toYaml $e.prestopResources | nindent 8 }}
      volumeMounts:
        - name: narwhal-bin
          mountPath: /narwhal/bin
    {{- with $init }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  containers:
    {{- toYaml (prepend $sidecars $container) | nindent 4 }}
  volumes:
    {{- toYaml $volumes | nindent 4 }}
{{- end -}}
