#!/bin/bash
# Drain-POST and readmission latency on a 16-engine dev fleet (docs/benchmarks.md).
#
#   engine-agent/examples/lifecycle_latency.sh LABEL BIN_DIR [WORK_DIR]
#
# Starts `narwhal-dev up --prefill 8 --decode 8 --hosts 2 --no-controller` (instant simulators,
# no role flips during the measurement) with the binaries in BIN_DIR
# (NARWHAL_BIN_DIR), then for four engines: times POST /narwhal/lifecycle/drain, waits for
# ready_to_stop, restarts the engine (`narwhal-dev restart`), and times the synchronous
# POST /narwhal/lifecycle/readmit. Prints "LABEL iid drain: CODE SECONDS readmit: CODE SECONDS".
# Then a wave of all 16: POST drain {"wave": true}, wait for the wave's ready_to_stop, restart
# every engine (the engines' own time, not timed), and time the synchronous POST readmit
# {"wave": true}. Prints "LABEL wave drain: CODE SECONDS readmit: CODE SECONDS".
# To compare agents, put an older narwhal-agent in a directory with links to the other
# binaries. Load the host with sockets first to see the scan cost, e.g.
#   (sleep 600 | target/release/examples/identity_bench hold 2000) &
set -u
LABEL=$1; BIN=$2; DIR=${3:-$(mktemp -d)}/dev-$LABEL
rm -rf "$DIR"; mkdir -p "$DIR"
NARWHAL_BIN_DIR=$BIN "$BIN/narwhal-dev" up --prefill 8 --decode 8 --hosts 2 --no-controller --dir "$DIR" \
  > "$DIR/up.out" 2> "$DIR/up.err" &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null' EXIT
for _ in $(seq 1 300); do [ -s "$DIR/fleet.ready.json" ] && break; sleep 0.1; done
C=$(jq -r .router.control "$DIR/fleet.ready.json")
for _ in $(seq 1 300); do curl -sf "$C/ready" >/dev/null && break; sleep 0.1; done
post() {
  curl -s -o "$DIR/last.json" -w '%{http_code} %{time_total}' \
    -H 'content-type: application/json' -d "$2" "$C$1"
}
for iid in p0 d1 p2 d3; do
  D=$(post /narwhal/lifecycle/drain "{\"engines\":[\"$iid\"],\"deadline_s\":30}")
  for _ in $(seq 1 200); do
    [ "$(curl -s "$C/narwhal/lifecycle" | jq -r ".engines.$iid.ready_to_stop")" = true ] && break
    sleep 0.05
  done
  NARWHAL_BIN_DIR=$BIN "$BIN/narwhal-dev" restart "$iid" --dir "$DIR" > /dev/null 2>&1
  R=$(post /narwhal/lifecycle/readmit "{\"engines\":[\"$iid\"]}")
  echo "$LABEL $iid drain: $D  readmit: $R"
done
D=$(post /narwhal/lifecycle/drain '{"wave":true,"deadline_s":30}')
for _ in $(seq 1 400); do
  [ "$(curl -s "$C/narwhal/lifecycle" | jq -r '.wave.ready_to_stop')" = true ] && break
  sleep 0.05
done
for iid in p0 p1 p2 p3 p4 p5 p6 p7 d0 d1 d2 d3 d4 d5 d6 d7; do
  NARWHAL_BIN_DIR=$BIN "$BIN/narwhal-dev" restart "$iid" --dir "$DIR" > /dev/null 2>&1
done
R=$(post /narwhal/lifecycle/readmit '{"wave":true}')
echo "$LABEL wave drain: $D  readmit: $R  ($(jq -c '.engines // . | length' "$DIR/last.json" 2>/dev/null) in answer)"
