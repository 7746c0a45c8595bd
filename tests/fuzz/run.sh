#!/usr/bin/env bash
# Runs the fuzz targets under AFL++ (cargo-afl, stable Rust) for SECONDS each, from the
# committed corpus (tests/fuzz/corpus/<target>), one after the other, and fails if any target
# found a crash or a hang (printing the target and each input as hex). docs/testing.md
# "Fuzzing" says how to run one target for long and how to keep a crash as a regression.
#
#   tests/fuzz/run.sh SECONDS [TARGET...]     (default: every target)
#
# Installs cargo-afl (pinned, --locked) and builds AFL++ when missing. Builds into
# target/afl (its own RUSTFLAGS would otherwise rebuild the normal target/ every time) and
# writes each run to target/afl/out/<target> (queue/, crashes/, hangs/, fuzzer_stats).
set -euo pipefail
cd "$(dirname "$0")/../.."

secs="${1:?usage: tests/fuzz/run.sh SECONDS [TARGET...]}"
shift
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  targets=(ingress relay handoff lifecycle fleet_config agent_config agent_protocol attestation kv_events)
fi

CARGO_AFL_VERSION=0.18.2
if ! cargo afl --version 2>/dev/null | grep -q "^cargo-afl $CARGO_AFL_VERSION "; then
  echo "== installing cargo-afl $CARGO_AFL_VERSION"
  cargo install cargo-afl --version "$CARGO_AFL_VERSION" --locked
fi
# Builds AFL++ for this toolchain once; it refuses (and changes nothing) when already built.
if ! config_out="$(cargo afl config --build 2>&1)"; then
  grep -q "already built" <<<"$config_out" || { echo "$config_out"; exit 1; }
fi

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_AFL:-target/afl}"
echo "== cargo afl build --release -p narwhal-fuzz --features afl"
cargo afl build --release -p narwhal-fuzz --features afl --bins

export AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_UI=1 AFL_NO_AFFINITY=1
mkdir -p "$CARGO_TARGET_DIR/out"
failed=()
for t in "${targets[@]}"; do
  out="$CARGO_TARGET_DIR/out/$t"
  rm -rf "$out"
  echo "== fuzz $t for ${secs} s"
  # -t: a hang is an input that takes over 2 s (well above any parser's time, even loaded).
  cargo afl fuzz -i "tests/fuzz/corpus/$t" -o "$out" -V "$secs" -t 2000 \
    -- "$CARGO_TARGET_DIR/release/fuzz-${t//_/-}" >"$out.log" 2>&1 \
    || { tail -20 "$out.log" || true; failed+=("$t (afl-fuzz failed)"); continue; }
  stats="$out/default/fuzzer_stats"
  get() { sed -n "s/^$1 *: //p" "$stats"; }
  echo "   execs $(get execs_done), corpus $(get corpus_count), edges $(get edges_found)/$(get total_edges), crashes $(get saved_crashes), hangs $(get saved_hangs)"
  for kind in crashes hangs; do
    for f in "$out/default/$kind"/id:*; do
      [ -e "$f" ] || continue
      echo "!! $t: $kind: $f"
      od -An -tx1 -v "$f" | head -40 || true  # head closes the pipe early (SIGPIPE under pipefail)
      failed+=("$t ($kind)")
    done
  done
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "error: fuzzing found: ${failed[*]}"
  exit 1
fi
echo "== fuzzing: no crash, no hang"
