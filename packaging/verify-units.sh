#!/usr/bin/env bash
# Verifies every systemd unit under packaging/systemd with systemd-analyze. ExecStart binaries
# must exist for `verify`, so the units are checked against this checkout's debug build.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --workspace --bins
bindir="${CARGO_TARGET_DIR:-$PWD/target}/debug"
case "$bindir" in /*) ;; *) bindir="$PWD/$bindir" ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for u in packaging/systemd/*.service; do
  sed "s#/usr/bin/#$bindir/#g" "$u" > "$tmp/$(basename "$u")"
done
systemd-analyze verify "$tmp"/*.service
echo "systemd-analyze verify: $(ls packaging/systemd/*.service | wc -l) unit(s) clean"
