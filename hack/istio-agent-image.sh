#!/usr/bin/env bash
# Builds Istio's own node agent as an image archive, for the switch tests
# (test/e2eswitch, `make e2e-switch`): install-cni (the ambient node agent and
# CNI installer) and istio-cni (the chained plugin), compiled from the
# test-only module test/istio-oracle at its pinned Istio revision (go.mod; the
# module proxy, never a fetched snapshot), on the same Debian layer as
# ambientd's image (hack/debian-rootfs.sh: iptables legacy and nft, nft,
# ipset), laid out as Istio's Dockerfile.install-cni does: /opt/cni/bin/istio-cni,
# /usr/local/bin/install-cni, PATH with /opt/cni/bin, CMD install-cni.
#
# The product module never depends on Istio; this is a test oracle. Cold, it
# costs the oracle module's cold build (~10 CPU-minutes, test/istio-oracle/README.md)
# plus ~35 s CPU; warm, seconds. Not part of `make check`.
#
#   hack/istio-agent-image.sh [OUT]   default OUT: bin/istio-agent-image.tar
#   ISTIO_AGENT_TAG=ref               default istio.local/e2e/install-cni:<istio revision>
set -euo pipefail
cd "$(dirname "$0")/.."
go run ./hack/ensure -name "${ENSURE_NAME:-make istio-agent-image}" istio-agent-image
out=${1:-bin/istio-agent-image.tar}
rev=$(awk '$1=="require" && $2=="istio.io/istio" {print $3}' test/istio-oracle/go.mod)
[ -n "$rev" ] || { echo "istio-agent-image: no 'require istio.io/istio' line in test/istio-oracle/go.mod" >&2; exit 1; }
tag=${ISTIO_AGENT_TAG:-istio.local/e2e/install-cni:${rev##*-}}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

start=$(date +%s)
istio="$work/istio"
# No -trimpath: the same build flags as `make istio-oracle`, so both share the
# Go build cache and the agent costs only its own packages on top of the
# oracle's (~35 s CPU); a test image does not care about embedded paths.
mkdir -p "$istio/usr/local/bin" "$istio/opt/cni/bin"
(cd test/istio-oracle && go build -o "$work/out/" istio.io/istio/cni/cmd/install-cni istio.io/istio/cni/cmd/istio-cni)
mv "$work/out/install-cni" "$istio/usr/local/bin/install-cni"
mv "$work/out/istio-cni" "$istio/opt/cni/bin/istio-cni"
chmod 0755 "$istio/usr/local/bin/install-cni" "$istio/opt/cni/bin/istio-cni"
built=$(( $(date +%s) - start ))

root="$work/rootfs"
roots=$(hack/debian-rootfs.sh "$root")

mkdir -p "$(dirname "$out")"
digest=$(go run ./hack/mkimage --layer "debian: ${roots}=$root" --layer "istio $rev: install-cni, istio-cni=$istio" \
  --tag "$tag" --version "$rev" --entrypoint "" --cmd /usr/local/bin/install-cni \
  --path /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin \
  --title istio-install-cni --source https://github.com/istio/istio --out "$out")
echo "image $tag"
echo "digest $digest"
echo "archive $out $(du -h "$out" | cut -f1); Istio binaries built in ${built}s"
