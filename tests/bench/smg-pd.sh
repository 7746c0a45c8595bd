#!/bin/sh
# Launches smg (Shepherd Model Gateway) in vLLM P/D mode as a `narwhal-bench --peer` command.
#
#   smg-pd.sh SMG_BIN PORT AUX_PORT PREFILL_URL DECODE_URL [EXTRA SMG FLAGS]
#
# smg relays vLLM NIXL kv_transfer_params over HTTP only for a prefill worker registered with its
# KV connector; the `--prefill URL` flag cannot say which connector it runs, and such a worker is
# served in passthrough mode (both legs run aggregated, nothing is transferred). So smg starts
# with the decode worker alone, and a short-lived helper registers the prefill worker through
# smg's admin API (`POST /workers` with `worker_type: prefill`, `runtime_type: vllm`,
# `kv_connector: NixlConnector`) once smg answers. Until then every request is refused ("no
# prefill workers"), so narwhal-bench's readiness probe waits for the registration. The router is
# exec'd: the benchmark measures smg's own process. Everything binds 127.0.0.1.
set -eu
[ $# -ge 5 ] || {
  echo "usage: smg-pd.sh SMG_BIN PORT AUX_PORT PREFILL_URL DECODE_URL [FLAGS]" >&2
  exit 2
}
smg="$1" port="$2" aux="$3" prefill="$4" decode="$5"
shift 5
python="$(dirname "$smg")/python"

"$python" - "$port" "$prefill" <<'EOF' &
import json, sys, time, urllib.request

port, prefill = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
body = json.dumps({"url": prefill, "worker_type": "prefill", "runtime_type": "vllm",
                   "kv_connector": "NixlConnector"}).encode()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        req = urllib.request.Request(f"{base}/workers", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=2) as r:
            if r.status in (200, 201, 202):
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.1)
print("smg-pd.sh: could not register the prefill worker", file=sys.stderr)
sys.exit(1)
EOF

exec "$smg" launch --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
  --prometheus-port "$aux" --log-level warn --backend vllm --pd-disaggregation \
  --policy round_robin --decode "$decode" "$@"
