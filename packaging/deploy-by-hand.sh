#!/usr/bin/env bash
# deploy-by-hand.sh: the deployment of docs/deploy.md, by hand, on one machine. Run by .ci/run;
# takes about a minute once the binaries are built.
#
# It runs the documentation, not a copy of it: every block between
# `<!-- BEGIN deploy:NAME -->` and `<!-- END deploy:NAME -->` in docs/security.md and
# docs/deploy.md is extracted and executed verbatim with bash, in the order of the walk-through,
# on the host the text says. A doc change that breaks the deployment fails here.
#
# The world it builds on loopback:
#   - a host is a directory ($ROOT/hosts/NAME) and a loopback address of its own
#     (127.N.0.11 gpu-a, .12 gpu-b, .21 router-a, .22 router-b), so the units' real ports
#     (8000, 8001, 8443) are used; /etc/, /var/lib/ and (shared by the router hosts) /srv/ in a
#     block are mapped into it;
#   - `systemctl` (a stand-in on PATH) starts a unit from packaging/systemd/ with its own
#     Environment=, EnvironmentFile=, StateDirectory=, ExecStartPre= and ExecStart= (the binaries
#     from target/debug), stops it with SIGTERM, kills, restarts and shows MainPID; the engine
#     simulator stands in for `vllm serve` with the engine unit's ENGINE_HOST, ENGINE_PORT and
#     ENGINE_MODEL;
#   - `ssh HOST CMD` (a stand-in on PATH) runs CMD on that host, for narwhal-restart-remote;
#   - what one user on one machine cannot show is left out and said so in docs/deploy.md
#     (users, chown, the units' sandboxing).
# Then it checks each stage's outcome and prints how long each took, the takeover after a
# kill -9 and the planned handover.
#
# Exit 0 when every stage passed; 1 naming the stage that failed, with the logs of every unit.
# NARWHAL_DEPLOY_KEEP=1 keeps the directory afterwards; NARWHAL_SKIP_BUILD=1 skips `cargo build`.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
fail() { echo "deploy-by-hand: FAILED: $*" >&2; exit 1; }
for tool in openssl curl jq setsid awk; do
  command -v "$tool" >/dev/null || fail "$tool not found (Debian: openssl, curl, jq, util-linux)"
done
[ -n "${NARWHAL_SKIP_BUILD:-}" ] || cargo build -q --workspace --bins
bin="${CARGO_TARGET_DIR:-$src/target}/debug"
case "$bin" in /*) ;; *) bin="$src/$bin" ;; esac
for b in narwhal-serve narwhal-agent narwhalctl narwhal-engine-sim; do
  [ -x "$bin/$b" ] || fail "$bin/$b not built"
done

root=$(mktemp -d /tmp/narwhal-deploy.XXXXXX)
cleanup() {
  local rc=$? p
  for p in "$root"/hosts/*/run/*.pid; do
    [ -f "$p" ] && kill -9 "$(cat "$p")" 2>/dev/null || true
  done
  if [ "$rc" != 0 ]; then
    for l in "$root"/hosts/*/run/*.log; do
      [ -f "$l" ] || continue
      echo "----- ${l#"$root"/hosts/} (last 30 lines)" >&2
      tail -30 "$l" >&2
    done
  fi
  if [ -n "${NARWHAL_DEPLOY_KEEP:-}" ]; then echo "kept: $root" >&2; else rm -rf "$root"; fi
}
trap cleanup EXIT

# --- loopback hosts --------------------------------------------------------------------------
listening() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
net=""
for _ in 1 2 3 4 5 6 7 8; do
  n=$((20 + RANDOM % 200))
  busy=0
  for ip in 11 12 21 22; do
    for port in 8000 8001 8443; do
      listening "127.$n.0.$ip" "$port" && busy=1
    done
  done
  [ "$busy" = 0 ] && { net=$n; break; }
done
[ -n "$net" ] || fail "ports 8000, 8001, 8443 answer on every loopback address tried (something listens on 0.0.0.0)"
GPU_A=127.$net.0.11 GPU_B=127.$net.0.12 ROUTER_A=127.$net.0.21 ROUTER_B=127.$net.0.22
MODEL=tiny-sim
printf '%s gpu-a\n%s gpu-b\n%s router-a\n%s router-b\n' "$GPU_A" "$GPU_B" "$ROUTER_A" "$ROUTER_B" \
  > "$root/hosts.map"
for h in ca gpu-a gpu-b router-a router-b operator; do
  mkdir -p "$root/hosts/$h/home" "$root/hosts/$h/run" "$root/hosts/$h/etc/narwhal" \
    "$root/hosts/$h/var/lib"
  : > "$root/hosts/$h/session"
done
mkdir -p "$root/shared/srv" "$root/bin"

# --- the stand-ins: systemctl and ssh ------------------------------------------------------
cat > "$root/bin/systemctl" <<'SHIM'
#!/usr/bin/env bash
# systemctl as deploy-by-hand.sh's hosts see it (see that script): the units of
# packaging/systemd/ with their own directives, per host.
set -euo pipefail
: "${DEPLOY_HOST:?systemctl: DEPLOY_HOST unset}"
h=$DEPLOY_ROOT/hosts/$DEPLOY_HOST
run=$h/run
die() { echo "systemctl ($DEPLOY_HOST): $*" >&2; exit 1; }
remap() {
  sed -e "s#/usr/bin/#$DEPLOY_BIN/#g" -e "s#/etc/#$h/etc/#g" -e "s#/var/lib/#$h/var/lib/#g" \
      -e "s#/srv/#$DEPLOY_ROOT/shared/srv/#g"
}
unit_of() { local u=${1%.service}; echo "$u"; }
file_of() {
  case $1 in
    *@*) echo "$DEPLOY_SRC/packaging/systemd/${1%%@*}@.service" ;;
    *) echo "$DEPLOY_SRC/packaging/systemd/$1.service" ;;
  esac
}
directives() { # unit key: its values, %i %H and paths mapped
  local f inst=""
  f=$(file_of "$1")
  [ -f "$f" ] || die "unit $1 not found ($f)"
  case $1 in *@*) inst=${1#*@} ;; esac
  { grep "^$2=" "$f" || true; } | sed -e "s#^$2=##" -e "s#%i#$inst#g" -e "s#%H#$DEPLOY_HOST#g" | remap
}
mainpid() {
  local p st
  p=$(cat "$run/$1.pid" 2>/dev/null) || { echo 0; return; }
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null) || { echo 0; return; }
  if [ "$st" = Z ] || [ "$st" = X ]; then echo 0; else echo "$p"; fi
}
start() {
  local u=$1
  [ "$(mainpid "$u")" = 0 ] || return 0
  (
    while IFS= read -r line; do [ -n "$line" ] && export "${line?}"; done < <(directives "$u" Environment)
    while IFS= read -r f; do
      opt=0
      case $f in -*) opt=1; f=${f#-} ;; esac
      if [ -f "$f" ]; then set -a; . "$f"; set +a
      elif [ "$opt" = 0 ]; then die "$u: EnvironmentFile $f does not exist"; fi
    done < <(directives "$u" EnvironmentFile)
    while IFS= read -r d; do [ -n "$d" ] && mkdir -p "$h/var/lib/$d"; done < <(directives "$u" StateDirectory)
    while IFS= read -r pre; do
      [ -n "$pre" ] || continue
      eval "set -- $pre"
      "$@" >> "$run/$u.log" 2>&1 || die "$u: ExecStartPre failed (exit $?): $pre (log: $run/$u.log)"
    done < <(directives "$u" ExecStartPre)
    case $u in
      narwhal-engine@*)
        # The simulator stands in for `vllm serve`, with the unit's address and model.
        set -- "$DEPLOY_BIN/narwhal-engine-sim" --listen "$ENGINE_HOST:$ENGINE_PORT" \
          --model "$ENGINE_MODEL" --dialect vllm --admin-listen 127.0.0.1:0 ;;
      *)
        exec_line=$(directives "$u" ExecStart)
        [ -n "$exec_line" ] || die "$u: no ExecStart"
        eval "set -- $exec_line" ;;
    esac
    echo "--- $(date +%T) start: $*" >> "$run/$u.log"
    setsid "$@" >> "$run/$u.log" 2>&1 < /dev/null &
    echo $! > "$run/$u.pid"
  )
}
signal() { # unit signal
  local p; p=$(mainpid "$1")
  [ "$p" = 0 ] || kill -s "$2" "$p" 2>/dev/null || true
}
stop() {
  local u=$1 p limit
  p=$(mainpid "$u")
  [ "$p" != 0 ] || { rm -f "$run/$u.pid"; return 0; }
  limit=$(directives "$u" TimeoutStopSec | tr -dc '0-9')
  limit=${limit:-90}
  kill -TERM "$p" 2>/dev/null || true
  for _ in $(seq 1 $((limit * 10))); do
    [ "$(mainpid "$u")" = 0 ] && break
    sleep 0.1
  done
  [ "$(mainpid "$u")" = 0 ] || kill -9 "$p" 2>/dev/null || true
  rm -f "$run/$u.pid"
}
[ $# -ge 1 ] || die "usage: systemctl COMMAND [UNIT]"
cmd=$1; shift
case $cmd in
  daemon-reload) ;;
  enable|disable)
    now=0; units=()
    for a in "$@"; do case $a in --now) now=1 ;; *) units+=("$(unit_of "$a")") ;; esac; done
    if [ "$now" = 1 ]; then
      for u in "${units[@]}"; do if [ "$cmd" = enable ]; then start "$u"; else stop "$u"; fi; done
    fi ;;
  start) for a in "$@"; do start "$(unit_of "$a")"; done ;;
  stop) for a in "$@"; do stop "$(unit_of "$a")"; done ;;
  restart) for a in "$@"; do stop "$(unit_of "$a")"; start "$(unit_of "$a")"; done ;;
  kill)
    sig=TERM; units=()
    while [ $# -gt 0 ]; do
      case $1 in -s|--signal) sig=$2; shift 2 ;; --signal=*) sig=${1#*=}; shift ;; *) units+=("$(unit_of "$1")"); shift ;; esac
    done
    for u in "${units[@]}"; do signal "$u" "$sig"; done ;;
  is-active)
    u=$(unit_of "$1")
    if [ "$(mainpid "$u")" != 0 ]; then echo active; else echo inactive; exit 3; fi ;;
  show)
    prop=""; u=""
    while [ $# -gt 0 ]; do
      case $1 in
        -p|--property) prop=$2; shift 2 ;;
        --property=*) prop=${1#*=}; shift ;;
        --value|--) shift ;;
        *) u=$(unit_of "$1"); shift ;;
      esac
    done
    [ "$prop" = MainPID ] || die "show: only MainPID is known here"
    mainpid "$u" ;;
  *) die "$cmd is not known here" ;;
esac
SHIM
cat > "$root/bin/ssh" <<'SHIM'
#!/usr/bin/env bash
# ssh as deploy-by-hand.sh's operator sees it: `ssh [options] HOST COMMAND` runs COMMAND with
# bash on HOST (a name or an address of $DEPLOY_ROOT/hosts.map), standard input passed on.
set -euo pipefail
while [ $# -gt 0 ]; do
  case $1 in -o|-p|-i|-l|-F) shift 2 ;; -*) shift ;; *) break ;; esac
done
target=${1:?ssh: no host}; shift
name=$(awk -v t="$target" '$1 == t || $2 == t { print $2; exit }' "$DEPLOY_ROOT/hosts.map")
[ -n "$name" ] || { echo "ssh: $target: unknown host" >&2; exit 255; }
cd "$DEPLOY_ROOT/hosts/$name/home"
DEPLOY_HOST=$name exec bash -c "$*"
SHIM
chmod +x "$root/bin/systemctl" "$root/bin/ssh"
ln -s "$src/packaging/narwhal-restart-remote" "$root/bin/narwhal-restart-remote"
export DEPLOY_ROOT=$root DEPLOY_SRC=$src DEPLOY_BIN=$bin
export PATH="$root/bin:$bin:$PATH"
export GPU_A GPU_B ROUTER_A ROUTER_B MODEL SRC="$src"

# --- running the documentation's blocks -------------------------------------------------------
# The block NAME of docs/FILE, without its code fences; empty when there is none.
block() {
  awk -v name="$2" '
    !on && index($0, "<!-- BEGIN deploy:" name " ") == 1 { on = 1; next }
    !on && $0 == "<!-- BEGIN deploy:" name " -->" { on = 1; next }
    on && index($0, "<!-- END deploy:" name) == 1 { exit }
    on && /^```/ { next }
    on { print }' "docs/$1"
}
declare -A took
# run_on HOST FILE NAME [VAR=VALUE...]: the block with /etc, /var/lib and /srv mapped into
# HOST's directory, run by bash -euo pipefail in HOST's home with the variables given and those
# the host's earlier blocks set (as in one shell session). Output goes to HOST/run/NAME.out.
run_on() {
  local host=$1 file=$2 name=$3 hd=$root/hosts/$1 text t0
  shift 3
  text=$(block "$file" "$name")
  [ -n "$text" ] || fail "docs/$file has no block deploy:$name (its markers were removed or renamed)"
  printf '%s\n' "$text" | sed -e "s#/etc/#$hd/etc/#g" -e "s#/var/lib/#$hd/var/lib/#g" \
    -e "s#/srv/#$root/shared/srv/#g" > "$hd/run/$name.sh"
  t0=$(date +%s.%N)
  if ! (
      cd "$hd/home"
      export DEPLOY_HOST=$host
      for kv in "$@"; do export "${kv?}"; done
      set -a; . "$hd/session"; set +a
      bash -euo pipefail "$hd/run/$name.sh"
    ) > "$hd/run/$name.out" 2>&1; then
    cat "$hd/run/$name.out" >&2
    fail "stage $name on $host (docs/$file, block deploy:$name): see its output above"
  fi
  took[$name]=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  # Top-level assignments stay for the host's later blocks (`CTL=...`); here-documents are text.
  awk '
    tag != "" { if ($0 == tag) tag = ""; next }
    match($0, /<<-?[ ]*["\x27]?[A-Za-z_]+/) {
      tag = substr($0, RSTART, RLENGTH); sub(/^<<-?[ ]*["\x27]?/, "", tag)
    }
    /^[A-Za-z_][A-Za-z0-9_]*=/ { print }' "$hd/run/$name.sh" >> "$hd/session"
  echo "deploy-by-hand: $name on $host: ok (${took[$name]} s)"
}
out_of() { cat "$root/hosts/$1/run/$2.out"; }
# wait_log HOST UNIT TEXT: until the unit's log holds TEXT (20 s).
wait_log() {
  local l=$root/hosts/$1/run/$2.log
  for _ in $(seq 1 200); do grep -q "$3" "$l" 2>/dev/null && return 0; sleep 0.1; done
  fail "$2 on $1 never logged '$3'"
}
curl_ctl() { # url: a control listener route, with the operator's certificate
  (cd "$root/hosts/operator/home" && curl -s --cacert ca.pem --cert alice.pem --key alice.key "$1")
}

# --- 1. certificates (docs/security.md) -------------------------------------------------------
run_on ca security.md certs \
  "AGENTS=gpu-a=$GPU_A gpu-b=$GPU_B" \
  "IDENTITIES=router/router-a=$ROUTER_A router/router-b=$ROUTER_B operator/alice"
grep -q "URI:spiffe://narwhal/router/router-a" "$root/hosts/ca/run/certs.out" \
  || fail "certs: router-a.pem has no router identity URI"
# Delivery (scp in real life): the CA's files to each host's /etc/narwhal, the operator's home.
ca=$root/hosts/ca/home
for h in gpu-a gpu-b; do cp "$ca/ca.pem" "$ca/agent-$h.pem" "$ca/agent-$h.key" "$root/hosts/$h/etc/narwhal/"; done
for h in router-a router-b; do cp "$ca/ca.pem" "$ca/$h.pem" "$ca/$h.key" "$root/hosts/$h/etc/narwhal/"; done
cp "$ca/ca.pem" "$ca/alice.pem" "$ca/alice.key" "$root/hosts/operator/home/"

# --- 2. GPU hosts -----------------------------------------------------------------------------
run_on gpu-a deploy.md gpu-host HOST=gpu-a "HOST_IP=$GPU_A" ENGINE_IID=e0
run_on gpu-b deploy.md gpu-host HOST=gpu-b "HOST_IP=$GPU_B" ENGINE_IID=e1
for h in gpu-a gpu-b; do wait_log "$h" narwhal-agent "narwhal-agent listening on https://"; done
KEY_GPU_A=$(DEPLOY_HOST=gpu-a narwhal-agent check-config --config "$root/hosts/gpu-a/etc/narwhal/agent.json")
KEY_GPU_B=$(DEPLOY_HOST=gpu-b narwhal-agent check-config --config "$root/hosts/gpu-b/etc/narwhal/agent.json")
grep -qx "$KEY_GPU_A" "$root/hosts/gpu-a/run/gpu-host.out" || fail "gpu-a: keygen and check-config print different keys"
export KEY_GPU_A KEY_GPU_B

# --- 3. router hosts --------------------------------------------------------------------------
run_on router-a deploy.md router-host ROUTER=router-a "ROUTER_IP=$ROUTER_A" INSTANCE=primary SERVE_ARGS=
wait_log router-a narwhal-serve@primary "narwhal-serve listening data=http://$ROUTER_A:8000 control=https://$ROUTER_A:8001"
run_on router-b deploy.md router-host ROUTER=router-b "ROUTER_IP=$ROUTER_B" INSTANCE=standby \
  "SERVE_ARGS=--standby-of https://$ROUTER_A:8001"
wait_log router-b narwhal-serve@standby "narwhal-serve listening"
for _ in $(seq 1 200); do
  [ "$(curl_ctl "https://$ROUTER_A:8001/ready" | jq -r .status 2>/dev/null)" = ready ] && break
  sleep 0.1
done
[ "$(curl_ctl "https://$ROUTER_B:8001/narwhal/state" | jq -r .ha.standby)" = true ] \
  || fail "router-b is not a standby"
[ "$(jq -r .holder "$root/shared/srv/narwhal-lease/router.lease" | cut -d: -f1)" = router-a ] \
  || fail "the lease is not held by router-a"

# --- 4. operate -------------------------------------------------------------------------------
run_on operator deploy.md operate
out_of operator operate | grep -q "router: controls_fleet=active ready=true" \
  || fail "operate: narwhalctl status does not show router-a in control and ready"
out_of operator operate | grep -q '"text_completion"' || fail "operate: no completion"
start_e0=$(curl_ctl "https://$ROUTER_A:8001/narwhal/lifecycle" | jq -r '.process_starts["e0"]')
run_on operator deploy.md drain
run_on gpu-a deploy.md restart-engine "HOST_IP=$GPU_A"
run_on operator deploy.md readmit
out_of operator readmit | grep -q "e0: checks passed: .*new process identity" \
  || fail "readmit: the checks of e0 are not listed"
new_e0=$(curl_ctl "https://$ROUTER_A:8001/narwhal/lifecycle" | jq -r '.process_starts["e0"]')
awk -v a="$start_e0" -v b="$new_e0" 'BEGIN { exit !(b > a) }' \
  || fail "readmit: e0's accepted process start did not advance ($start_e0 -> $new_e0)"
run_on operator deploy.md wave
curl_ctl "https://$ROUTER_A:8001/narwhal/lifecycle" \
  | jq -e '[.engines[] | .state] | all(. == "active")' >/dev/null || fail "wave: not every engine is active"

# --- 5. failover and fail-back ----------------------------------------------------------------
epoch_a=$(jq -r .epoch "$root/shared/srv/narwhal-lease/router.lease")
run_on router-a deploy.md crash
run_on operator deploy.md takeover
takeover=${took[crash]}+${took[takeover]}
out_of operator takeover | grep -q "router: controls_fleet=active ready=true" \
  || fail "takeover: router-b does not control the fleet"
[ "$(jq -r .epoch "$root/shared/srv/narwhal-lease/router.lease")" = $((epoch_a + 1)) ] \
  || fail "takeover: the lease epoch did not advance by one"
run_on router-a deploy.md rejoin
wait_log router-a narwhal-serve@standby "narwhal-serve listening"
epoch_b=$((epoch_a + 1))
for _ in $(seq 1 200); do
  f=$root/hosts/router-a/var/lib/narwhal/state.json
  [ "$(curl_ctl "https://$ROUTER_A:8001/narwhal/state" | jq -r .ha.standby 2>/dev/null)" = true ] \
    && [ -f "$f" ] && [ "$(jq -r .epoch "$f" 2>/dev/null)" = "$epoch_b" ] && break
  sleep 0.1
done
[ "$(jq -r .epoch "$root/hosts/router-a/var/lib/narwhal/state.json")" = "$epoch_b" ] \
  || fail "rejoin: router-a never retained router-b's handoff"
run_on router-b deploy.md handover
run_on operator deploy.md handed-back
out_of operator handed-back | grep -q "router: controls_fleet=active ready=true" \
  || fail "handed-back: router-a does not control the fleet"

# The fence reset of docs/operate.md ("A router fenced by its agents"), mechanically: shown,
# reset while stopped, the agent back (router-a's next call raises the fence again).
run_on gpu-a operate.md fence-reset
out_of gpu-a fence-reset | grep -q '"epoch":[1-9]' || fail "fence-reset: fence show printed no epoch"
for _ in $(seq 1 200); do
  [ "$(grep -c 'narwhal-agent listening' "$root/hosts/gpu-a/run/narwhal-agent.log")" = 2 ] && break
  sleep 0.1
done
[ "$(grep -c 'narwhal-agent listening' "$root/hosts/gpu-a/run/narwhal-agent.log")" = 2 ] \
  || fail "fence-reset: the agent did not start again"

echo "deploy-by-hand: passed: CA by OpenSSL (docs/security.md), 2 GPU hosts (engine + agent units),"
echo "  primary + standby on a file lease, mutual TLS to agents and on the control listener,"
echo "  drain/restart/readmit, rolling wave, kill -9 failover, fail-back (docs/deploy.md), fence reset"
printf 'deploy-by-hand: takeover after kill -9: %s s (kill, then until router-b /ready 200)\n' \
  "$(awk "BEGIN { printf \"%.1f\", $takeover }")"
printf 'deploy-by-hand: planned handover: %s s (systemctl stop, then until router-a /ready 200)\n' \
  "$(awk "BEGIN { printf \"%.1f\", ${took[handover]} + ${took[handed-back]} }")"
