#!/usr/bin/env bash
# Unpacks the Debian packages the node agents' images share into DIR: the
# tools both iptables variants need, nft and ipset, with every dependency
# Debian declares (no recommends), from public package registries only
# (apt-get download into .cache/image/debs, dpkg-deb -x: no maintainer
# scripts run). Timestamps are SOURCE_DATE_EPOCH, so the tree is the same
# bytes each time. Used by hack/image.sh (ambientd's image) and
# hack/istio-agent-image.sh (Istio's node agent for the switch tests).
#
#   hack/debian-rootfs.sh DIR      DIR must not exist or be empty
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:?usage: hack/debian-rootfs.sh DIR}
: "${SOURCE_DATE_EPOCH:?SOURCE_DATE_EPOCH must be set}"
cache=.cache/image

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
echo "${roots[*]}"
