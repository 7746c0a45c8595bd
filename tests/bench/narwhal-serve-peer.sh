#!/bin/sh
# Launches narwhal-serve as a `narwhal-bench --peer` command: writes a fleet file over the engine
# URLs it is given and execs the router on 127.0.0.1:PORT, so the process the benchmark measures
# is narwhal-serve itself. Used by the comparison mode's CI test (tests/tests/e2e/bench_compare.rs)
# and to compare two builds of our own router (docs/benchmarks.md, "Peers").
#
#   narwhal-serve-peer.sh --bin PATH --port PORT --dir DIR [--backend vllm|sglang]
#                         [--prefill URL]... [--decode URL]... [--engine URL]...
#                         [-- EXTRA NARWHAL-SERVE FLAGS]
#
# --engine URLs join the fleet as decode engines: with no prefill engine the router serves each
# request from one engine (the aggregated path). The fleet is written to DIR/fleet.json, the
# journal to DIR/journal.jsonl.
set -eu

bin=""
port=""
dir=""
backend="vllm"
engines=""
n=0
add_engine() { # role url
  n=$((n + 1))
  [ -n "$engines" ] && engines="$engines,"
  engines="$engines{\"iid\": \"$1$n\", \"url\": \"$2\", \"role\": \"$1\"}"
}
usage() {
  echo "narwhal-serve-peer.sh: $1" >&2
  echo "usage: narwhal-serve-peer.sh --bin PATH --port PORT --dir DIR [--backend B] [--prefill URL]... [--decode URL]... [--engine URL]... [-- FLAGS]" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --dir) dir="${2:?}"; shift 2 ;;
    --backend) backend="${2:?}"; shift 2 ;;
    --prefill) add_engine prefill "${2:?}"; shift 2 ;;
    --decode) add_engine decode "${2:?}"; shift 2 ;;
    --engine) add_engine decode "${2:?}"; shift 2 ;;
    --) shift; break ;;
    *) usage "unknown argument $1" ;;
  esac
done
[ -n "$bin" ] || usage "--bin is required"
[ -n "$port" ] || usage "--port is required"
[ -n "$dir" ] || usage "--dir is required"
[ -n "$engines" ] || usage "no engines (--prefill/--decode/--engine)"
mkdir -p "$dir"
cat >"$dir/fleet.json" <<EOF
{
  "schema": "narwhal.fleet",
  "schema_version": 2,
  "model": "tiny-sim",
  "backend": "$backend",
  "engines": [$engines],
  "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
  "serving": {"max_connections": 4096},
  "recovery": {"state_path": "$dir/state.json"}
}
EOF
exec "$bin" --fleet "$dir/fleet.json" --listen "127.0.0.1:$port" --control-listen 127.0.0.1:0 \
  --journal "$dir/journal.jsonl" --log-level warn "$@"
