{{/*
narwhal.enginePod: the pod template of one engine (vLLM or SGLang) that leaves the fleet through
the router before it stops (docs/kubernetes.md, "Engine pods"). Use it as the `template:` of
your own engine Deployment (one Deployment per engine: the fleet file names each engine by its
iid and URL):

  spec:
    replicas: 1
    strategy: {type: Recreate}
    selector:
      matchLabels: {narwhal.dev/iid: e0, ...}
    template:
      {{- include "narwhal.enginePod" (dict "root" $ "iid" "e0" "role" "prefill"
            "container" $engineContainer "pod" (dict "nodeSelector" ...)) | nindent 6 }}

Arguments (a dict):
  root       the chart's root context ($), required
  iid        the engine's iid in the fleet file, required
  role       prefill | decode | aggregated: the label narwhal.dev/role (PodDisruptionBudgets
             select by it), required
  container  the engine container (a dict in the Pod API's shape), required; it must not set
             lifecycle.preStop (the helper sets it)
  pod        more pod spec fields (nodeSelector, tolerations, affinity, volumes, more
             initContainers or containers, ...), optional
  labels     more pod labels, optional
  drain      overrides of engines.drain (deadlineSeconds, waitSeconds), optional
  hostNetwork  overrides engines.hostNetwork, optional

What it adds:
  - labels narwhal.dev/role, narwhal.dev/iid and the chart's selector labels with
    app.kubernetes.io/component: engine;
  - an init container that copies narwhalctl from the Narwhal image into a shared volume (the
    engine's image does not have it; it needs glibc 2.34 or newer, as Debian bookworm's or
    Ubuntu 22.04's);
  - the engine container's preStop hook: `narwhalctl --router <control Service> drain <iid>
    --wait --deadline-s D --timeout-s W`: the router stops placing on the engine, the engine's
    resident requests finish, and the hook returns once the router reports the engine
    ready_to_stop (or W seconds passed, or the router refused); then the kubelet sends SIGTERM;
  - terminationGracePeriodSeconds = W + engines.engineShutdownSeconds + engines.marginSeconds,
    so the kubelet never cuts the drain short;
  - hostNetwork (default true): the agent finds an engine by its listening port only in the
    host's network namespace (docs/agent.md, "Limits").
*/}}
{{- define "narwhal.enginePod" -}}
{{- $root := required "narwhal.enginePod: root ($) is required" .root -}}
{{- $iid := required "narwhal.enginePod: iid is required" .iid -}}
{{- $role := required "narwhal.enginePod: role is required" .role -}}
{{- if not (has $role (list "prefill" "decode" "aggregated")) -}}
{{- fail (printf "narwhal.enginePod: role %q: expected prefill, decode or aggregated" $role) -}}
{{- end -}}
{{- $e := $root.Values.engines -}}
{{- $drain := merge (deepCopy (default (dict) .drain)) (deepCopy $e.drain) -}}
{{- $wait := int $drain.waitSeconds -}}
{{- if lt $wait (int $drain.deadlineSeconds) -}}
{{- fail (printf "narwhal.enginePod %s: drain.waitSeconds (%d) must be at least drain.deadlineSeconds (%d)" $iid $wait (int $drain.deadlineSeconds)) -}}
{{- end -}}
{{- $hostNetwork := $e.hostNetwork -}}
{{- if hasKey . "hostNetwork" -}}{{- $hostNetwork = .hostNetwork -}}{{- end -}}
{{- $routerURL := default (include "narwhal.controlURL" $root) $e.routerURL -}}
{{- $container := deepCopy (required "narwhal.enginePod: container is required" .container) -}}
{{- if not (hasKey $container "name") -}}{{- $_ := set $container "name" "engine" -}}{{- end -}}
{{- $lifecycle := default (dict) (get $container "lifecycle") -}}
{{- if hasKey $lifecycle "preStop" -}}
{{- fail (printf "narwhal.enginePod %s: the container sets lifecycle.preStop; the helper's preStop drains the engine through the router" $iid) -}}
{{- end -}}
{{- $cmd := list "/narwhal/bin/narwhalctl" "--router" $routerURL -}}
{{- if $root.Values.router.controlTLS.enabled -}}
{{- $cmd = concat $cmd (list "--ca" "/narwhal/control-tls/ca.crt" "--cert" "/narwhal/control-tls/tls.crt" "--key" "/narwhal/control-tls/tls.key") -}}
{{- with $e.controlClientTLS.serverName -}}
{{- $cmd = concat $cmd (list "--server-name" .) -}}
{{- end -}}
{{- end -}}
{{- $cmd = concat $cmd (list "--request-timeout-s" (toString (int $e.requestTimeoutSeconds)) "drain" $iid "--wait" "--deadline-s" (toString (int $drain.deadlineSeconds)) "--timeout-s" (toString $wait)) -}}
{{- $_ := set $lifecycle "preStop" (dict "exec" (dict "command" $cmd)) -}}
{{- $_ := set $container "lifecycle" $lifecycle -}}
{{- $mounts := default (list) (get $container "volumeMounts") -}}
{{- $mounts = append $mounts (dict "name" "narwhal-bin" "mountPath" "/narwhal/bin" "readOnly" true) -}}
{{- if $root.Values.router.controlTLS.enabled -}}
{{- $mounts = append $mounts (dict "name" "narwhal-control-tls" "mountPath" "/narwhal/control-tls" "readOnly" true) -}}
{{- end -}}
{{- $_ := set $container "volumeMounts" $mounts -}}
{{- $pod := deepCopy (default (dict) .pod) -}}
{{- $volumes := default (list) (get $pod "volumes") -}}
{{- $volumes = append $volumes (dict "name" "narwhal-bin" "emptyDir" (dict "sizeLimit" "64Mi")) -}}
{{- if $root.Values.router.controlTLS.enabled -}}
{{- $secret := required "engines.controlClientTLS.secretName is required with router.controlTLS.enabled (narwhalctl's client certificate for the drain)" $e.controlClientTLS.secretName -}}
{{- $volumes = append $volumes (dict "name" "narwhal-control-tls" "secret" (dict "secretName" $secret "defaultMode" 0444)) -}}
{{- end -}}
{{- $_ := unset $pod "volumes" -}}
{{- $init := default (list) (get $pod "initContainers") -}}
{{- $_ := unset $pod "initContainers" -}}
{{- $sidecars := default (list) (get $pod "containers") -}}
{{- $_ := unset $pod "containers" -}}
{{- $grace := add $wait (int $e.engineShutdownSeconds) (int $e.marginSeconds) -}}
metadata:
  labels:
    {{- include "narwhal.selectorLabels" $root | nindent 4 }}
    app.kubernetes.io/component: engine
    app.kubernetes.io/part-of: narwhal
    narwhal.dev/role: {{ $role }}
    narwhal.dev/iid: {{ $iid | quote }}
    {{- with .labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  # narwhalctl's wait (drain.waitSeconds), then the engine's own shutdown
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
    # narwhalctl for the preStop hook, from the Narwhal image.
    - name: narwhalctl
      image: {{ include "narwhal.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["cp", "/usr/bin/narwhalctl", "/narwhal/bin/narwhalctl"]
      securityContext:
        {{- toYaml (merge (dict "runAsNonRoot" true "runAsUser" 10001 "runAsGroup" 10001) (deepCopy $root.Values.router.securityContext)) | nindent 8 }}
      resources:
        {{- toYaml $e.narwhalctlResources | nindent 8 }}
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
