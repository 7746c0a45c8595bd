#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2 from Debian
# bookworm's own source package of Kubernetes, with Debian's Go, into DEST (default
# $NARWHAL_CACHE_DIR or ~/.cache/narwhal, under k8s-v1.20.2/bin). Idempotent: a DEST that
# already holds the three binaries is left alone. Needs root for apt-get (CI runs as root).
#
# Why this route: no newer API server is published in any registry CI can reach, and none of
# kind, k3s, minikube or envtest ships through them (docs/kubernetes.md, "What is tested").
# About 3 minutes of two cores cold; the Go build cache (1.7 GB) is removed afterwards.
set -euo pipefail

PKG_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
cache="${NARWHAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/narwhal}"
dest="${1:-$cache/k8s-v1.20.2/bin}"
bins=(kube-apiserver kube-controller-manager kube-scheduler)

have_all() {
  for b in "${bins[@]}"; do [ -x "$dest/$b" ] || return 1; done
}
if have_all; then
  echo "k8s control plane already built in $dest"
  exit 0
fi

work="$cache/k8s-build"
rm -rf "$work"
mkdir -p "$work/apt/lists/partial" "$work/src" "$dest"

export DEBIAN_FRONTEND=noninteractive
apt_pkgs=()
command -v go >/dev/null 2>&1 || apt_pkgs+=(golang-go)
command -v rsync >/dev/null 2>&1 || apt_pkgs+=(rsync)
command -v make >/dev/null 2>&1 || apt_pkgs+=(make)
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] || apt_pkgs+=(golang-github-modern-go-reflect2-dev)
command -v dpkg-source >/dev/null 2>&1 || apt_pkgs+=(dpkg-dev)
if [ "${#apt_pkgs[@]}" -gt 0 ]; then
  echo "installing: ${apt_pkgs[*]}"
  apt-get update -qq >/dev/null 2>&1 || true
  apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi

# The source package, through a private source list so the system's lists stay as they are.
cat > "$work/apt/sources.list" <<LIST
deb-src http://deb.debian.org/debian bookworm main
deb-src http://deb.debian.org/debian-security bookworm-security main
deb-src http://deb.debian.org/debian bookworm-updates main
LIST
apt_opts=(-o "Dir::State::Lists=$work/apt/lists" -o "Dir::Etc::SourceList=$work/apt/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null")
apt-get "${apt_opts[@]}" update -qq
(cd "$work/src" && apt-get "${apt_opts[@]}" source --download-only "kubernetes=$PKG_VERSION" >/dev/null)
dsc=$(ls "$work/src"/kubernetes_*.dsc)
(cd "$work/src" && dpkg-source --no-check -x "$dsc" tree >/dev/null)

# GOPATH mode, as upstream 1.20 builds.
export GOPATH="$work/gopath" GO111MODULE=off GOFLAGS=-mod=vendor GOCACHE="$work/gocache"
unset GOFLAGS
mkdir -p "$GOPATH/src/k8s.io"
ln -s "$work/src/tree" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"

# reflect2 1.0.1 (vendored) crashes the API server under Go >= 1.18 on the first object with
# annotations; Debian's 1.0.2 does not.
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2

make gen_openapi >/dev/null

ldflags=""
for p in k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version k8s.io/kubernetes/vendor/k8s.io/component-base/version; do
  ldflags+=" -X $p.gitVersion=v1.20.2 -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
done
for b in "${bins[@]}"; do
  echo "building $b"
  go build -ldflags "-s -w $ldflags" -o "$dest/$b.tmp" "./cmd/$b"
  mv "$dest/$b.tmp" "$dest/$b"
done
cd /
rm -rf "$work"
have_all
echo "k8s control plane built in $dest"
