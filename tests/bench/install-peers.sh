#!/usr/bin/env bash
# Installs the peer routers that `narwhal-bench --peer` compares ours with, each into a cached
# Python virtualenv outside the clone, and prints the `--peer` specs that launch them
# (docs/benchmarks.md). Not part of CI: the benchmark is run by hand.
#
#   tests/bench/install-peers.sh             vllm-router 0.1.17
#   tests/bench/install-peers.sh --with-smg  and smg 1.13.0 (Shepherd Model Gateway)
#   tests/bench/install-peers.sh --specs     print the specs of what is installed; build nothing
#   tests/bench/install-peers.sh --prefix    print the cache-aware specs of `narwhal-bench prefix`
#                                            instead (with --specs: build nothing)
#
# Where: ${NARWHAL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}/peers/<name>-<version>-<key>,
# <key> hashing this script's recipe version and the interpreter. The last stdout lines are the
# specs, one per line (`name=command`), also written to <cache>/peers/specs.txt; progress goes to
# stderr.
#
# Guarantees (as tests/python/ensure-venv.sh):
# - The peer's own wheel is checked against the SHA-256 pinned below before it is installed
#   (its dependencies are resolved by pip; `pip freeze` of the result is kept as freeze.txt).
# - Atomic: a venv is built in `.build-*` and published by renaming a symlink onto it, after the
#   install, `pip check` and the entry point's `--help` succeeded. Builds are serialised by
#   `flock`; a waiter reuses what the first builder published.
#
# The peers are only ever run on loopback: every spec binds 127.0.0.1 (and the metrics listener
# of vllm-router, which defaults to 127.0.0.1:29000, is moved to a free port of its own so two
# instances can run side by side).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipe=1 # bump when the build steps change in a way the key would not see
python="${NARWHAL_PYTHON:-python3}"
cache="${NARWHAL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}/peers"

# name version wheel-sha256 entry-point
vllm_router=(vllm-router 0.1.17 85c96bea4d573a49b5a8ae4c72ee3dfe733aba26b6f1ff1256e6142f1f42694d vllm-router)
smg=(smg 1.13.0 cfae8171dac68a74b4822263b1864fa79952992ee472a25ba7266ccd200399b4 smg)

mode=build
with_smg=0
workload=compare
for a in "$@"; do
  case "$a" in
    --with-smg) with_smg=1 ;;
    --specs) mode=specs ;;
    --prefix) workload=prefix ;;
    -h | --help)
      sed -n '2,14p' "$0"
      exit 0
      ;;
    *)
      echo "usage: $0 [--with-smg] [--specs] [--prefix]" >&2
      exit 2
      ;;
  esac
done

log() { echo "install-peers: $*" >&2; }

command -v "$python" >/dev/null 2>&1 || {
  log "error: no Python interpreter '$python' (set NARWHAL_PYTHON)"
  exit 1
}
interp="$("$python" -c 'import os, platform, sys; print(sys.implementation.name, platform.python_version(), platform.machine(), os.path.realpath(sys.executable))')"
key="$(printf '%s\n' "recipe=$recipe" "$interp" | sha256sum | cut -c1-12)"

venv_of() { echo "$cache/$1-$2-$key"; }
usable() { # venv entry-point
  [ -f "$1/.narwhal-peer-complete" ] && "$1/bin/$2" --help >/dev/null 2>&1
}

# install name version sha256 entry-point
install() {
  local name="$1" version="$2" sha="$3" entry="$4"
  local venv
  venv="$(venv_of "$name" "$version")"
  if usable "$venv" "$entry"; then
    log "$name $version: $venv (cached)"
    return 0
  fi
  mkdir -p "$cache"
  exec 9>"$cache/build.lock"
  flock -w 1800 9 || {
    log "error: could not take $cache/build.lock within 30 minutes"
    exit 1
  }
  if usable "$venv" "$entry"; then
    log "$name $version: $venv (built by another process)"
    exec 9>&-
    return 0
  fi
  local previous build build_log start
  previous="$(readlink "$venv" 2>/dev/null || true)"
  start=$(date +%s)
  build="$(mktemp -d "$cache/.build-$name-$version-$key.XXXXXX")"
  chmod 755 "$build"
  build_log="$build/build.log"
  fail() {
    log "error: $1; the last lines of $build_log:"
    tail -n 30 "$build_log" >&2 || true
    exit 1
  }
  log "$name $version: building $venv (log: $build_log)"
  "$python" -m venv "$build" >>"$build_log" 2>&1 || fail "python -m venv failed"
  local pip=("$build/bin/python" -m pip --disable-pip-version-check --no-input)
  mkdir -p "$build/wheel"
  "${pip[@]}" download --no-deps --only-binary :all: -d "$build/wheel" "$name==$version" \
    >>"$build_log" 2>&1 || fail "downloading $name==$version from PyPI failed"
  local wheel got
  wheel="$(ls "$build"/wheel/*.whl)"
  got="$(sha256sum "$wheel" | cut -d' ' -f1)"
  [ "$got" = "$sha" ] || fail "$wheel has SHA-256 $got, expected $sha"
  "${pip[@]}" install "$wheel" >>"$build_log" 2>&1 || fail "installing $wheel failed"
  "${pip[@]}" check >>"$build_log" 2>&1 || fail "pip check found inconsistent dependencies"
  "$build/bin/$entry" --help >>"$build_log" 2>&1 || fail "$entry --help failed"
  "${pip[@]}" freeze >"$build/freeze.txt"
  rm -rf "$build/wheel"
  printf '%s\n' "$name==$version" "$interp" >"$build/.narwhal-peer-complete"
  ln -sfn "$(basename "$build")" "$venv.tmp.$$"
  mv -Tf "$venv.tmp.$$" "$venv"
  if [ -n "$previous" ] && [ "$previous" != "$(basename "$build")" ]; then
    rm -rf "${cache:?}/$(basename "$previous")"
  fi
  exec 9>&-
  log "$name $version: ready in $(($(date +%s) - start)) s"
}

if [ "$mode" = build ]; then
  install "${vllm_router[@]}"
  if [ "$with_smg" = 1 ]; then install "${smg[@]}"; fi
fi

# The specs (narwhal-bench's placeholders: docs/benchmarks.md, "Peers").
specs=()
vr="$(venv_of "${vllm_router[0]}" "${vllm_router[1]}")"
if usable "$vr" vllm-router; then
  common="--host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {aux_port} --log-level warning"
  if [ "$workload" = prefix ]; then
    # cache_aware: its approximate prefix tree over request text; kv_aware: its policy fed by
    # the engines' KV event streams (one --kv-event-source/--kv-event-replay-source per worker).
    specs+=("vllm-router-ca=$vr/bin/vllm-router $common --policy cache_aware --worker-urls {engine_urls}")
    kv_sources="\$(for s in {kv_event_sources}; do printf -- '--kv-event-source %s ' \"\$s\"; done)"
    kv_replays="\$(for s in {kv_event_replay_sources}; do printf -- '--kv-event-replay-source %s ' \"\$s\"; done)"
    specs+=("vllm-router-kv=$vr/bin/vllm-router $common --policy kv_aware --worker-urls {engine_urls} $kv_sources $kv_replays --kv-event-block-size 16 --kv-event-model {model}")
  else
    # One --prefill and one --decode flag per engine (one each under --compare; a fleet under
    # fleet-scale).
    prefills="\$(for u in {prefill_urls}; do printf -- '--prefill %s ' \"\$u\"; done)"
    decodes="\$(for u in {decode_urls}; do printf -- '--decode %s ' \"\$u\"; done)"
    specs+=("vllm-router-pd=$vr/bin/vllm-router $common --vllm-pd-disaggregation --policy round_robin $prefills $decodes")
    specs+=("vllm-router-rr=$vr/bin/vllm-router $common --policy round_robin --worker-urls {engine_urls}")
  fi
else
  log "vllm-router ${vllm_router[1]} is not installed (run $0)"
fi
sv="$(venv_of "${smg[0]}" "${smg[1]}")"
if usable "$sv" smg; then
  smg_common="launch --host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {aux_port} --log-level warn --backend vllm"
  if [ "$workload" = prefix ]; then
    specs+=("smg-ca=$sv/bin/smg $smg_common --policy cache_aware --worker-urls {engine_urls}")
  else
    # P/D through a wrapper that registers the prefill worker with its KV connector (smg-pd.sh).
    specs+=("smg-pd=sh $here/smg-pd.sh $sv/bin/smg {port} {aux_port} {prefill_url} {decode_url}")
    specs+=("smg-rr=$sv/bin/smg $smg_common --policy round_robin --worker-urls {engine_urls}")
  fi
fi
if [ "${#specs[@]}" -gt 0 ]; then
  mkdir -p "$cache"
  if [ "$workload" = prefix ]; then out="$cache/prefix-specs.txt"; else out="$cache/specs.txt"; fi
  printf '%s\n' "${specs[@]}" >"$out"
  printf '%s\n' "${specs[@]}"
fi
