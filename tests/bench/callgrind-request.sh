#!/usr/bin/env bash
# Instructions per request of narwhal-serve, counted by callgrind (repeatable whatever else the
# machine is doing, unlike a throughput A/B on a shared 2-core machine: docs/benchmarks.md).
#
#   tests/bench/callgrind-request.sh BIN_DIR [pd|aggregated] [stream true|false]
#
# Starts the engine simulators from BIN_DIR (a prefill and a decode for `pd`, one engine for
# `aggregated`), then narwhal-serve from BIN_DIR under `valgrind --tool=callgrind` twice: once
# for W warm-up requests (default 50), once for W + N (default 1000), each request sent after
# the previous answered. Prints the instructions per request, (second total - first) / N, in
# the router's own code and libraries (callgrind does not count the kernel). Compare two builds
# by running it with each BIN_DIR (release builds: `cargo build --release --bins`).
# Needs valgrind, curl and python3; loopback only.
set -euo pipefail
BIN="${1:?usage: callgrind-request.sh BIN_DIR [pd|aggregated] [true|false]}"
SHAPE="${2:-pd}"
STREAM="${3:-false}"
N="${N:-1000}"
W="${W:-50}"
DIR="$(mktemp -d -t narwhal-callgrind.XXXXXX)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT

field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
wait_file() { for _ in $(seq 1 600); do [ -s "$1" ] && return 0; sleep 0.1; done; echo "no $1" >&2; exit 2; }

sim() { # NAME [flags]
  local n=$1; shift
  "$BIN/narwhal-engine-sim" --dialect vllm --engine-id "$n" --ready-file "$DIR/$n.ready" "$@" \
    >"$DIR/$n.out" 2>"$DIR/$n.err" &
  PIDS+=($!)
  wait_file "$DIR/$n.ready"
}

if [ "$SHAPE" = pd ]; then
  sim p0; sim d0
  ENGINES="[{\"iid\":\"p0\",\"role\":\"prefill\",\"url\":\"$(field "$DIR/p0.ready" url)\"},
            {\"iid\":\"d0\",\"role\":\"decode\",\"url\":\"$(field "$DIR/d0.ready" url)\"}]"
else
  sim e0
  ENGINES="[{\"iid\":\"e0\",\"role\":\"decode\",\"url\":\"$(field "$DIR/e0.ready" url)\"}]"
fi
cat >"$DIR/fleet.json" <<EOF
{"schema": "narwhal.fleet", "schema_version": 2, "model": "tiny-sim", "backend": "vllm",
 "engines": $ENGINES, "slo": {"ttft_s": 2, "tpot_s": 0.05},
 "recovery": {"state_path": "$DIR/state.json"}}
EOF

# run COUNT: the router's instruction total after COUNT requests.
run() {
  local count=$1 out="$DIR/cg.$1"
  rm -f "$DIR/router.ready"
  valgrind --tool=callgrind --callgrind-out-file="$out" \
    "$BIN/narwhal-serve" --fleet "$DIR/fleet.json" --listen 127.0.0.1:0 \
    --control-listen 127.0.0.1:0 --ready-file "$DIR/router.ready" \
    >"$DIR/router.out" 2>"$DIR/router.err" &
  local pid=$!
  wait_file "$DIR/router.ready"
  local data
  data="$(field "$DIR/router.ready" data)"
  for i in $(seq 1 "$count"); do
    curl -sf -o /dev/null -H 'content-type: application/json' "$data/v1/completions" \
      -d "{\"model\":\"tiny-sim\",\"prompt\":\"callgrind request $i\",\"max_tokens\":16,\"stream\":$STREAM}" \
      || { echo "request $i failed" >&2; kill "$pid"; exit 1; }
  done
  kill -TERM "$pid"
  wait "$pid" || true
  sed -n 's/^summary: //p; s/^totals: //p' "$out" | head -1 | awk '{print $1}'
}

first=$(run "$W")
second=$(run "$((W + N))")
python3 -c "import sys; a,b,n=map(int,sys.argv[1:]); print(f'{(b-a)/n/1000:.1f} thousand instructions per request ($SHAPE, stream $STREAM, {n} requests; totals {a} and {b})')" \
  "$first" "$second" "$N"
