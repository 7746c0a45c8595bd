#!/usr/bin/env bash
# Checks the monitoring files in packaging/ with promtool (Debian package `prometheus`):
#   1. `promtool check rules` on the alert rules (syntax, PromQL, templates);
#   2. `promtool test rules` on their unit tests (every alert fires when it should, and not
#      otherwise);
#   3. every PromQL expression of the Grafana dashboard parses (`promtool check rules` on them as
#      recording rules, Grafana's $__rate_interval and variables replaced), and the JSON is valid;
#   4. `promtool check config` on the example scrape configuration (TLS files stubbed).
# Which metric names they may use is checked by tests/tests/e2e/monitoring_e2e.rs against a live router.
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v promtool >/dev/null || { echo "check-monitoring: promtool not found (apt-get install prometheus)" >&2; exit 1; }
command -v jq >/dev/null || { echo "check-monitoring: jq not found (apt-get install jq)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rules=packaging/prometheus/narwhal-alerts.yml
promtool check rules "$rules"
(cd packaging/prometheus && promtool test rules narwhal-alerts.test.yml)

dash=packaging/grafana/narwhal-dashboard.json
jq -e '.panels | length > 0' "$dash" >/dev/null || { echo "check-monitoring: $dash is not a dashboard" >&2; exit 1; }
{
  echo "groups:"
  echo "  - name: dashboard-expressions"
  echo "    rules:"
  n=0
  while IFS= read -r expr; do
    n=$((n + 1))
    expr=${expr//\$__rate_interval/5m}
    expr=${expr//\$router_job/narwhal-router}
    expr=${expr//\$agent_job/narwhal-agent}
    echo "      - record: dashboard:expr_$n"
    printf "        expr: '%s'\n" "${expr//\'/\'\'}"
  done < <(jq -r '[.. | objects | select(has("expr")) | .expr] | .[]' "$dash")
} > "$tmp/dashboard-rules.yml"
grep -q 'record: dashboard:expr_1$' "$tmp/dashboard-rules.yml" || { echo "check-monitoring: no expressions in $dash" >&2; exit 1; }
if ! promtool check rules "$tmp/dashboard-rules.yml" > "$tmp/dash.log" 2>&1; then
  cat "$tmp/dash.log" >&2
  echo "check-monitoring: a PromQL expression in $dash does not parse (see above)" >&2
  exit 1
fi
echo "dashboard: $(grep -c 'record:' "$tmp/dashboard-rules.yml") PromQL expressions parse"

# Example scrape configuration: promtool checks the TLS files exist, so point them at stubs.
mkdir -p "$tmp/etc"
for f in ca.pem prometheus.pem prometheus.key; do : > "$tmp/etc/$f"; done
cp "$rules" "$tmp/narwhal-alerts.yml"
sed -e "s#/etc/narwhal/#$tmp/etc/#g" -e "s#/etc/prometheus/narwhal-alerts.yml#$tmp/narwhal-alerts.yml#" \
  packaging/prometheus/prometheus.example.yml > "$tmp/prometheus.yml"
promtool check config "$tmp/prometheus.yml"
