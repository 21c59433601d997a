#!/usr/bin/env bash
# Builds the agent image as an OCI archive, without a container engine, from
# public package registries only: the iptables/nftables/ipset tools and their
# libraries as Debian packages (apt-get download + dpkg-deb -x, no maintainer
# scripts run), ambientd and ambientd-cni from this tree, assembled by
# hack/mkimage (go-containerregistry). Reproducible: same packages and tree →
# same digest (SOURCE_DATE_EPOCH defaults to the last commit's time).
#
#   hack/image.sh [OUT]      default OUT: bin/ambientd-image.tar
#   IMAGE_TAG=ref            the reference recorded in the archive
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bin/ambientd-image.tar}
tag=${IMAGE_TAG:-ghcr.io/ambientd/ambientd:dev}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
version=$(git describe --always --dirty 2>/dev/null || echo dev)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The tools both iptables variants need (and nft, ipset), with every
# dependency Debian declares, no recommends (hack/debian-rootfs.sh).
root="$work/rootfs"
roots=$(hack/debian-rootfs.sh "$root")

bin="$work/ambientd"
mkdir -p "$bin/usr/local/bin"
# Built as `make build` builds them (test/infra/build.Programs), stamped.
go run ./hack/ensure programs -out "$bin/usr/local/bin" -version "$version" ambientd ambientd-cni
chmod 0755 "$bin/usr/local/bin/"*

mkdir -p "$(dirname "$out")"
digest=$(go run ./hack/mkimage --layer "debian: ${roots}=$root" --layer "ambientd $version=$bin" --tag "$tag" --version "$version" --out "$out")
echo "image $tag"
echo "digest $digest"
echo "archive $out $(du -h "$out" | cut -f1) ($(stat -c %s "$out") bytes); unpacked $(du -sh "$root" "$bin" | awk '{print $1}' | paste -sd+ )"
