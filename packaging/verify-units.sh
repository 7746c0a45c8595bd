#!/usr/bin/env bash
# Verifies what packaging/ ships for systemd, without a running systemd:
#   1. `systemd-analyze verify` of every unit, template instances (narwhal-serve@primary,
#      narwhal-serve@standby, narwhal-engine@8000) and the lease-path drop-ins, against this
#      checkout's debug binaries (ExecStart binaries must exist for `verify`);
#   2. the hardening block of narwhal-serve.service and narwhal-serve@.service is identical;
#   3. sysusers.d and tmpfiles.d applied to a scratch root create the users and directories
#      with the owners and modes the units expect;
#   4. the ExecStartPre (`narwhal-serve check-config`) and ExecStart lines of narwhal-serve.service
#      and narwhal-serve@.service, expanded with
#      the shipped env files as systemd would (Environment= defaults, then EnvironmentFile=,
#      `${VAR}` one word, `$VAR` split), start real routers: a single router with --resume, and
#      a primary and a warm standby sharing a file lease; the control listener binds every
#      address. Ports are replaced by free ones; everything else is the shipped text.
# Exits non-zero on the first failure, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --workspace --bins
bindir="${CARGO_TARGET_DIR:-$PWD/target}/debug"
case "$bindir" in /*) ;; *) bindir="$PWD/$bindir" ;; esac
tmp=$(mktemp -d)
# Routers are started inside $(...) subshells: their pids go to a file, not a variable.
cleanup() {
  local p left
  for p in $(cat "$tmp/pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  for _ in $(seq 1 100); do
    left=0
    for p in $(cat "$tmp/pids" 2>/dev/null); do kill -0 "$p" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.1
  done
  for p in $(cat "$tmp/pids" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "verify-units: FAILED: $*" >&2; exit 1; }

# --- 1. systemd-analyze verify ------------------------------------------------------------
units="$tmp/units"
mkdir -p "$units"
for u in packaging/systemd/*.service; do
  sed -e "s#/usr/bin/#$bindir/#g" -e "s#/opt/vllm/bin/vllm#/bin/true#g" "$u" > "$units/$(basename "$u")"
done
for d in packaging/systemd/*.d; do
  mkdir -p "$units/$(basename "$d")"
  for f in "$d"/*.conf.example; do
    cp "$f" "$units/$(basename "$d")/$(basename "$f" .example)"
  done
done
# Template instances, as an operator starts them.
for inst in narwhal-serve@primary narwhal-serve@standby narwhal-engine@8000; do
  cp "$units/${inst%%@*}@.service" "$units/$inst.service"
done
# verify exits 0 on unknown keys and bad values it ignores ("Unknown key ..., ignoring"): any
# output at all is a failure here.
if ! (cd "$units" && systemd-analyze verify --man=no ./*.service) > "$tmp/verify.log" 2>&1 \
    || [ -s "$tmp/verify.log" ]; then
  cat "$tmp/verify.log" >&2
  fail "systemd-analyze verify"
fi
n=$(ls packaging/systemd/*.service | wc -l)
echo "systemd-analyze verify: $n unit file(s), 3 template instances and the drop-ins clean"

# --- 2. one hardening block for both router units ------------------------------------------
hardening() { sed -n '/^# --- Hardening/,/^ReadWritePaths/p' "$1"; }
diff <(hardening packaging/systemd/narwhal-serve.service) \
     <(hardening packaging/systemd/narwhal-serve@.service) >/dev/null \
  || fail "the hardening blocks of narwhal-serve.service and narwhal-serve@.service differ"
[ -n "$(hardening packaging/systemd/narwhal-serve.service)" ] || fail "no hardening block found"
echo "hardening: narwhal-serve.service and narwhal-serve@.service agree"

# --- 3. sysusers.d and tmpfiles.d in a scratch root ----------------------------------------
root="$tmp/root"
mkdir -p "$root/etc"
systemd-sysusers --root="$root" "$PWD/packaging/sysusers.d/narwhal.conf" > "$tmp/sysusers.log" 2>&1 \
  || { cat "$tmp/sysusers.log" >&2; fail "systemd-sysusers packaging/sysusers.d/narwhal.conf"; }
for user in narwhal narwhal-agent narwhal-engine; do
  grep -q "^$user:" "$root/etc/passwd" || fail "sysusers.d did not create user $user"
  grep -q "^$user:" "$root/etc/group" || fail "sysusers.d did not create group $user"
done
systemd-tmpfiles --root="$root" --create "$PWD/packaging/tmpfiles.d/narwhal.conf" \
  || fail "systemd-tmpfiles packaging/tmpfiles.d/narwhal.conf"
uid_of() { if [ "$1" = root ]; then echo 0; else awk -F: -v u="$1" '$1 == u { print $3 }' "$root/etc/passwd"; fi; }
expect_dir() { # path mode user
  [ -d "$root$1" ] || fail "tmpfiles.d did not create $1"
  local got
  got=$(stat -c '%a %u' "$root$1")
  [ "$got" = "$2 $(uid_of "$3")" ] || fail "$1 is '$got' (mode uid), want '$2 $(uid_of "$3")' ($3)"
}
expect_dir /var/lib/narwhal 750 narwhal
expect_dir /var/lib/narwhal-agent 700 narwhal-agent
expect_dir /etc/narwhal 755 root
echo "sysusers.d/tmpfiles.d: users narwhal, narwhal-agent, narwhal-engine; state directories owned right"

# --- 4. the routers' ExecStart lines with the shipped env files ----------------------------
# Expands unit $1 (instance $2, env file $3) the way systemd does and prints one argument per
# line. Port numbers in the env file are replaced by $4 (data) and $5 (control) first.
expand_exec() {
  local unit=$1 inst=$2 envfile=$3 data=$4 control=$5 key=${6:-ExecStart}
  (
    set -euo pipefail
    while IFS= read -r line; do
      line=${line//%i/$inst}
      line=${line//%H/testhost}
      eval "export ${line#Environment=}"
    done < <(grep '^Environment=' "$unit")
    sed -e "s#:8000\$#:$data#" -e "s#:8001\$#:$control#" "$envfile" > "$tmp/env.$inst"
    set -a
    # shellcheck disable=SC1090
    . "$tmp/env.$inst"
    set +a
    local exec
    exec=$(grep "^$key=" "$unit")
    exec=${exec#"$key="}
    exec=${exec//%i/$inst}
    exec=${exec/#\/usr\/bin\//$bindir/}
    eval "set -- $exec"
    printf '%s\n' "$@"
  )
}
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((20000 + RANDOM % 20000))
}
http_get() { # host port path -> status line and body on stdout
  exec 3<>"/dev/tcp/$1/$2" || return 1
  printf 'GET %s HTTP/1.0\r\nHost: %s\r\n\r\n' "$3" "$1" >&3
  cat <&3
  exec 3<&-
}
# Starts a router from argument file $1 (one argument per line), label $2; waits for its
# `listening` line and prints the control URL.
start_router() {
  local args=() a
  while IFS= read -r a; do args+=("$a"); done < "$1"
  : > "$tmp/$2.out"
  "${args[@]}" > "$tmp/$2.out" 2> "$tmp/$2.err" &
  echo "$!" >> "$tmp/pids"
  for _ in $(seq 1 300); do
    if grep -q '^narwhal-serve listening' "$tmp/$2.out"; then
      sed -n 's/.* control=\([^ ]*\).*/\1/p' "$tmp/$2.out"
      return 0
    fi
    kill -0 "$!" 2>/dev/null || { cat "$tmp/$2.err" >&2; fail "$2 exited: ${args[*]}"; }
    sleep 0.1
  done
  fail "$2 did not start: ${args[*]}"
}
fleet() { # lease-json state-path
  cat <<JSON
{"schema": "narwhal.fleet", "schema_version": 2, "model": "m", "backend": "vllm",
 "engines": [{"iid": "e0", "url": "http://127.0.0.1:9", "role": "prefill"},
             {"iid": "e1", "url": "http://127.0.0.1:9", "role": "decode"}],
 "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
 "recovery": {"state_path": "$2"},
 "lease": $1}
JSON
}
state_field() { # host port jq-less extraction of "<key>":<value> from /narwhal/state
  http_get "$1" "$2" /narwhal/state | tr -d '\n' | grep -o "\"$3\":[a-z0-9\"]*" | head -1
}

mkdir -p "$tmp/var"
# Single router: NARWHAL_FLEET and NARWHAL_JOURNAL point into the scratch directory.
fleet '{"backend": "none"}' "$tmp/var/state.json" > "$tmp/fleet-single.json"
sed -e "s#^NARWHAL_FLEET=.*#NARWHAL_FLEET=$tmp/fleet-single.json#" \
    -e "s#^NARWHAL_JOURNAL=.*#NARWHAL_JOURNAL=$tmp/var/journal.jsonl#" \
    packaging/env/narwhal-serve.env > "$tmp/single.env"
expand_exec packaging/systemd/narwhal-serve.service "" "$tmp/single.env" "$(free_port)" "$(free_port)" > "$tmp/single.args"
grep -qx -- '--resume' "$tmp/single.args" || fail "NARWHAL_SERVE_ARGS was not split into flags"
# ExecStartPre: check-config with the same flags accepts what the run will use.
check_pre() { # unit inst envfile label
  expand_exec "$1" "$2" "$3" 1 2 ExecStartPre > "$tmp/$4.pre"
  local args=() a
  while IFS= read -r a; do args+=("$a"); done < "$tmp/$4.pre"
  [ "${args[1]}" = check-config ] || fail "$1: ExecStartPre is not narwhal-serve check-config"
  "${args[@]}" > "$tmp/$4.pre.out" 2> "$tmp/$4.pre.err" \
    || { cat "$tmp/$4.pre.err" >&2; fail "$1 ($4): ExecStartPre check-config failed"; }
  grep -q ' ok: ' "$tmp/$4.pre.out" || fail "$1 ($4): check-config printed no summary"
}
check_pre packaging/systemd/narwhal-serve.service "" "$tmp/single.env" single
control=$(start_router "$tmp/single.args" single)
case "$control" in http://0.0.0.0:*) ;; *) fail "single router control listener $control is not on every address" ;; esac
port=${control##*:}
http_get 127.0.0.1 "$port" /narwhal/state | grep -q '"schema":"narwhal.state"' \
  || fail "single router: /narwhal/state not served on 127.0.0.1:$port"
echo "narwhal-serve.service: ExecStartPre (check-config) and ExecStart + env/narwhal-serve.env start a router (control $control)"

# Primary and standby (narwhal-serve@.service), one file lease.
lease="{\"backend\": \"file\", \"path\": \"$tmp/var/router.lease.json\", \"ttl_s\": 2.0, \"renew_interval_s\": 0.5, \"safety_margin_s\": 0.5}"
fleet "$lease" "$tmp/var/state-primary.json" > "$tmp/fleet-primary.json"
fleet "$lease" "$tmp/var/state-standby.json" > "$tmp/fleet-standby.json"
for inst in primary standby; do
  sed -e "s#^NARWHAL_FLEET=.*#NARWHAL_FLEET=$tmp/fleet-$inst.json#" \
      -e "\$a NARWHAL_JOURNAL=$tmp/var/journal-$inst.jsonl" \
      "packaging/env/serve-$inst.env" > "$tmp/$inst.env"
done
check_pre packaging/systemd/narwhal-serve@.service primary "$tmp/primary.env" primary
expand_exec packaging/systemd/narwhal-serve@.service primary "$tmp/primary.env" "$(free_port)" "$(free_port)" > "$tmp/primary.args"
pcontrol=$(start_router "$tmp/primary.args" primary)
pport=${pcontrol##*:}
# The standby's --standby-of names the primary's control listener.
sed -i "s#https://router-a.internal:8001#http://127.0.0.1:$pport#" "$tmp/standby.env"
check_pre packaging/systemd/narwhal-serve@.service standby "$tmp/standby.env" standby
expand_exec packaging/systemd/narwhal-serve@.service standby "$tmp/standby.env" "$(free_port)" "$(free_port)" > "$tmp/standby.args"
grep -qx -- '--standby-of' "$tmp/standby.args" || fail "serve-standby.env did not make a standby"
scontrol=$(start_router "$tmp/standby.args" standby)
sport=${scontrol##*:}
for _ in $(seq 1 100); do
  [ "$(state_field 127.0.0.1 "$pport" controls_fleet)" = '"controls_fleet":true' ] \
    && [ "$(state_field 127.0.0.1 "$sport" standby)" = '"standby":true' ] && break
  sleep 0.1
done
[ "$(state_field 127.0.0.1 "$pport" controls_fleet)" = '"controls_fleet":true' ] \
  || fail "narwhal-serve@primary does not control the fleet"
[ "$(state_field 127.0.0.1 "$sport" standby)" = '"standby":true' ] \
  || fail "narwhal-serve@standby is not a standby"
grep -q "\"holder\":\"router-a:" "$tmp/var/router.lease.json" \
  || fail "the lease holder is not NARWHAL_ROUTER_ID=router-a"
echo "narwhal-serve@.service: check-config passes and primary (router-a, lease holder) and standby (router-b) start from env/serve-*.env"
