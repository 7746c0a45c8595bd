#!/usr/bin/env bash
# Creates (or reuses) the cached Python virtualenv of the end-to-end tests that drive real
# third-party software: the official `openai` SDK (tests/tests/e2e/sdk_e2e.rs) and llama.cpp's OpenAI
# server from llama-cpp-python (tests/tests/e2e/llamacpp_e2e.rs). Prints the venv's path as the last
# line on stdout; progress goes to stderr.
#
#   tests/python/ensure-venv.sh           build if missing (minutes: llama.cpp compiles from source)
#   tests/python/ensure-venv.sh --find    print the path if it is built, else exit 3 (no build)
#
# Where: ${NARWHAL_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}/venv-<key>, outside the
# clone, so fresh clones on the same machine share it. <key> hashes everything that decides the
# venv's content: both requirement files, the llama.cpp build flags below, this script's recipe
# version and the interpreter (version, machine, path). Change any of them and a new venv is built.
#
# Guarantees:
# - Idempotent: a published venv is reused as it is (checked to still start and import).
# - Atomic: the venv is built in `.build-<key>.<random>` and published by renaming a symlink
#   `venv-<key>` onto it, only after every package installed, `pip check` passed and the test
#   imports worked. An interrupted build never publishes; its leftovers are removed by the next
#   build of the same key. (A symlink, not a moved directory: a venv records its own path.)
# - Parallel-safe: builds are serialised by `flock` on `<cache>/build.lock`; a waiter rechecks
#   after taking the lock and reuses what the first builder published.
# - The compiled llama-cpp-python wheel is cached on its own (`wheels-<wheel key>`, keyed by the
#   llama pin, build backend, flags and interpreter only), so a venv rebuilt for another reason
#   (say an `openai` bump) takes seconds, not a llama.cpp compile.
#
# llama.cpp is compiled CPU-only and portable: no BLAS, no OpenMP, no -march=native, and no
# instruction set beyond x86-64-v2 (SSE4.2), so a cached venv keeps working when CI lands on
# another x86_64 machine. The test model is tiny; speed does not matter.
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

llama_cmake_args=(
  -DGGML_NATIVE=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_AVX512=OFF -DGGML_FMA=OFF
  -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=OFF -DGGML_CUDA=OFF
  -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
)

log() { echo "ensure-venv: $*" >&2; }
# An error: to stderr, and as the last line on stdout, where the test kit reads it to name the
# cause in its panic.
die() {
  log "error: $*"
  echo "error: $*"
  exit 1
}
# run_logged WHAT CMD...: runs CMD with its output appended to the build log, and says every
# 20 s how long WHAT has taken and what the log's last line is (a compile step, with cmake's
# percentage), so a long build is never silent.
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
llama_pin="$(grep -E '^llama-cpp-python' "$here/requirements.txt")"
llama_spec="$(sed -E 's/\[[^]]*\]//' <<<"$llama_pin")" # llama-cpp-python==X, without extras
# What decides the llama-cpp-python wheel, and what decides the whole venv.
wheel_key="$(printf '%s\n' "recipe=$recipe" "$interp" "$llama_pin" "${llama_cmake_args[*]}" \
  | cat - "$here/requirements-build.txt" | sha256sum | cut -c1-16)"
key="$(printf '%s\n' "recipe=$recipe" "$interp" "${llama_cmake_args[*]}" \
  | cat - "$here/requirements-build.txt" "$here/requirements.txt" "$here/vllm-source.txt" \
    "$here/sglang-source.txt" \
  | sha256sum | cut -c1-16)"
venv="$cache/venv-$key"

# A published venv: the symlink resolves, the completion marker is there, and the interpreter it
# points at still starts (a removed base Python breaks a venv).
usable() {
  [ -f "$venv/.narwhal-venv-complete" ] && [ -f "$venv/vllm-src/vllm/distributed/kv_events.py" ] \
    && [ -f "$venv/sglang-src/sglang/srt/disaggregation/kv_events.py" ] \
    && "$venv/bin/python" -c 'import openai, llama_cpp.server.app, gguf, numpy, msgspec, zmq' >/dev/null 2>&1
}

if usable; then
  echo "$venv"
  exit 0
fi
if [ "$mode" = find ]; then
  log "no built venv at $venv (run tests/python/ensure-venv.sh to build it)"
  exit 3
fi

# What a build needs, named before anything is built: the venv module, and a C and a C++
# compiler when the llama-cpp-python wheel is not cached yet (llama.cpp compiles from source).
"$python" -c 'import venv, ensurepip' >/dev/null 2>&1 \
  || die "$python has no venv/ensurepip module: install it (Debian: apt-get install python3-venv)"
if ! ls "$cache/wheels-$wheel_key"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || command -v clang >/dev/null 2>&1 \
    || die "no C compiler (cc, gcc or clang) on PATH: llama-cpp-python compiles llama.cpp from source (Debian: apt-get install gcc g++)"
  command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 \
    || die "no C++ compiler (c++, g++ or clang++) on PATH: llama-cpp-python compiles llama.cpp from source (Debian: apt-get install g++)"
fi

mkdir -p "$cache"
exec 9>"$cache/build.lock"
log "taking the build lock $cache/build.lock"
flock -w 5400 9 || die "could not take $cache/build.lock within 90 minutes"
if usable; then # another process built it while we waited
  echo "$venv"
  exit 0
fi

# Under the lock nothing else builds: a build dir no published venv points at, and a temporary
# wheel dir, are leftovers of an interrupted build.
for d in "$cache"/.build-* "$cache"/.wheels-*.tmp.*; do
  [ -e "$d" ] || continue
  keep=0
  for link in "$cache"/venv-*; do
    [ -L "$link" ] && [ "$(readlink "$link")" = "$(basename "$d")" ] && keep=1
  done
  [ "$keep" = 1 ] || rm -rf "$d"
done
previous="$(readlink "$venv" 2>/dev/null || true)"

start=$(date +%s)
build="$(mktemp -d "$cache/.build-$key.XXXXXX")"
chmod 755 "$build" # mktemp makes it private; the venv is for any user of the cache
build_log="$build/build.log"
fail() {
  log "the last lines of $build_log:"
  tail -n 40 "$build_log" >&2 || true
  die "$1 (log: $build_log)"
}
log "building $venv (log: $build_log)"
"$python" -m venv "$build" >>"$build_log" 2>&1 || fail "python -m venv failed"
pip=("$build/bin/python" -m pip --disable-pip-version-check --no-input)
"${pip[@]}" install --no-deps -r "$here/requirements-build.txt" >>"$build_log" 2>&1 \
  || fail "installing the build backend failed"

wheels="$cache/wheels-$wheel_key"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  log "compiling llama.cpp (the llama-cpp-python wheel; about 6 minutes on 2 cores, once per"
  log "machine: the wheel is cached in $cache/wheels-$wheel_key)"
  tmp_wheels="$(mktemp -d "$cache/.wheels-$wheel_key.tmp.XXXXXX")"
  chmod 755 "$tmp_wheels"
  CMAKE_ARGS="${llama_cmake_args[*]}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    run_logged "compiling llama.cpp" "${pip[@]}" wheel -v --no-deps --no-build-isolation \
    --no-cache-dir -w "$tmp_wheels" "$llama_spec" \
    || fail "building the llama-cpp-python wheel failed"
  rm -rf "$wheels"
  mv -T "$tmp_wheels" "$wheels"
  log "llama-cpp-python wheel built in $(($(date +%s) - start)) s"
fi

log "installing the pinned packages (tests/python/requirements.txt)"
run_logged "installing packages" "${pip[@]}" install --no-deps --find-links "$wheels" \
  --only-binary llama-cpp-python -r "$here/requirements.txt" \
  || fail "installing requirements.txt failed"
"${pip[@]}" check >>"$build_log" 2>&1 || fail "pip check found inconsistent pins"
"$build/bin/python" -c 'import openai, llama_cpp.server.app, gguf, numpy, msgspec, zmq' >>"$build_log" 2>&1 \
  || fail "the installed packages do not import"

# The engines' own KV events files (tests/python/vllm-source.txt, sglang-source.txt): each pinned
# wheel is downloaded without its dependencies and only the listed files are kept, in
# <venv>/<engine>-src.
extract_source() { # extract_source ENGINE
  local engine=$1 list="$here/$1-source.txt" pin dl
  pin="$(grep -Ev '^(#|$)' "$list" | head -n 1)"
  log "extracting $engine's KV events files from $pin (the wheel is not installed)"
  dl="$(mktemp -d "$build/.$engine-wheel.XXXXXX")"
  run_logged "downloading $pin" "${pip[@]}" download --no-deps --no-cache-dir --only-binary :all: \
    -d "$dl" "$pin" || fail "downloading $pin failed"
  grep -Ev '^(#|$)' "$list" | tail -n +2 >"$dl/files"
  "$build/bin/python" - "$dl" "$build/$engine-src" <<'PY' >>"$build_log" 2>&1 || fail "extracting $engine's files from the wheel failed"
import glob, os, sys, zipfile
dl, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(dl, "*.whl"))
names = [n.strip() for n in open(os.path.join(dl, "files")) if n.strip()]
with zipfile.ZipFile(wheel) as z:
    for n in names:
        z.extract(n, dest)  # a missing name raises KeyError: the pin and the list disagree
PY
  rm -rf "$dl"
}
extract_source vllm
extract_source sglang
printf '%s\n' "$interp" "${llama_cmake_args[*]}" >"$build/.narwhal-venv-complete"

# Publish: rename a fresh symlink over the name (atomic on one filesystem).
ln -sfn "$(basename "$build")" "$venv.tmp.$$"
mv -Tf "$venv.tmp.$$" "$venv"
if [ -n "$previous" ]; then rm -rf "${cache:?}/$(basename "$previous")"; fi
log "venv ready in $(($(date +%s) - start)) s"
echo "$venv"
