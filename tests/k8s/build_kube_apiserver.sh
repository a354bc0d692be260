#!/usr/bin/env bash
# Build kube-apiserver (Kubernetes 1.20.2) from Debian's source package, once per machine.
#
# No registry ships a prebuilt kube-apiserver; Debian's `kubernetes` source package holds
# the whole tree with its vendored modules, so it builds offline with Debian's Go. The
# binary is cached outside the repository (KVROUTE_CACHE, default ~/.cache/kvroute) and
# later calls return at once. Needs root for apt-get (the test fixture skips otherwise).
# Prints the binary's path on its last line.
set -euo pipefail
cache="${KVROUTE_CACHE:-$HOME/.cache/kvroute}/kube-apiserver-1.20.2"
binary="$cache/kube-apiserver"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi

apt_get() { apt-get -o DPkg::Lock::Timeout=600 "$@"; }
if [ ! -e /etc/apt/sources.list.d/kvroute-deb-src.sources ]; then
  cat > /etc/apt/sources.list.d/kvroute-deb-src.sources <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
apt_get update -qq >&2
# rsync must be there before the build, or the generators it runs leave a broken tree.
DEBIAN_FRONTEND=noninteractive apt_get install -y -qq --no-install-recommends \
  golang-go rsync jq etcd-server etcd-client >&2

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
apt_get source --download-only kubernetes >&2
tar xzf kubernetes_*.orig.tar.gz
cd kubernetes-1.20.2
mkdir -p .go/src/k8s.io && ln -s ../../.. .go/src/k8s.io/kubernetes
GOPATH="$PWD/.go" CGO_ENABLED=0 HOME="$PWD/.home" GOFLAGS=-mod=vendor \
  make WHAT=cmd/kube-apiserver >&2
cp _output/bin/kube-apiserver "$binary.tmp"
mv "$binary.tmp" "$binary"
echo "$binary"
