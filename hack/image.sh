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
cache=.cache/image
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The tools both iptables variants need (and nft, ipset), with every
# dependency Debian declares, no recommends.
roots=(iptables nftables ipset)
mkdir -p "$cache/debs"
pkgs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances "${roots[@]}" | grep -v '^ ' | grep -v '^<' | sort -u)
debs=()
for p in $pkgs; do
  v=$(apt-cache policy "$p" | awk '/Candidate:/ {print $2}')
  f=$(ls "$cache/debs/${p}_"*.deb 2>/dev/null | grep -F "_${v/:/%3a}_" | head -1 || true)
  if [ -z "$f" ]; then
    (cd "$cache/debs" && apt-get download -q -o APT::Sandbox::User=root "$p=$v" >/dev/null)
    f=$(ls "$cache/debs/${p}_"*.deb | grep -F "_${v/:/%3a}_" | head -1)
  fi
  debs+=("$f")
done

root="$work/rootfs"
mkdir -p "$root"
for d in "${debs[@]}"; do dpkg-deb -x "$d" "$root"; done
# Documentation, manuals, locales and the package's own config snippets for
# tools it does not run are not needed to run iptables.
rm -rf "$root"/usr/share/{doc,man,info,locale,lintian,bug} "$root"/etc/init.d "$root"/etc/default "$root"/etc/logrotate.d
mkdir -p "$root"/{tmp,run,var/run,etc,proc,sys,dev}
chmod 1777 "$root/tmp"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\n' >"$root/etc/group"
# The loader cache, so the libraries resolve exactly as on Debian.
ldconfig -r "$root" 2>/dev/null || true
# Same bytes each build: no umask or extraction-order differences.
find "$root" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

bin="$work/ambientd"
mkdir -p "$bin/usr/local/bin"
# Built as `make build` builds them (test/infra/build.Programs), stamped.
go run ./hack/ensure programs -out "$bin/usr/local/bin" -version "$version" ambientd ambientd-cni
chmod 0755 "$bin/usr/local/bin/"*

mkdir -p "$(dirname "$out")"
digest=$(go run ./hack/mkimage --layer "debian: ${roots[*]}=$root" --layer "ambientd $version=$bin" --tag "$tag" --version "$version" --out "$out")
echo "image $tag"
echo "digest $digest"
echo "archive $out $(du -h "$out" | cut -f1) ($(stat -c %s "$out") bytes); unpacked $(du -sh "$root" "$bin" | awk '{print $1}' | paste -sd+ )"
