#!/usr/bin/env bash
# Installs the Debian packages that building, testing and the demo need, but
# only when something is missing (or when AMBIENTD_APT_UPDATE=always, as CI
# sets). Safe to run again and again.
#
#   hack/deps.sh        what build, test, e2e and the demo need
#   hack/deps.sh node   also containerd and runc, for the real node (make e2e-node)
set -euo pipefail

# binary -> Debian package that provides it
declare -A want=(
  [iptables]=iptables
  [iptables-legacy]=iptables
  [iptables-nft]=iptables
  [ip6tables]=iptables
  [ipset]=ipset
  [nft]=nftables
  [ip]=iproute2
  [protoc]=protobuf-compiler
  [modprobe]=kmod
  [conntrack]=conntrack
  [ps]=procps
  [make]=make
  [gcc]=gcc
  [flock]=util-linux
  [nsenter]=util-linux
  # make image / image-test: Debian packages into a rootfs, a throwaway containerd
  [dpkg-deb]=dpkg
  [containerd]=containerd
  [ctr]=containerd
  [runc]=runc
  [podman]=podman
  # make bench: the plugin ADD's instruction count (callgrind)
  [valgrind]=valgrind
)
case "${1:-}" in
  "") ;;
  node) want+=([containerd]=containerd [ctr]=containerd [containerd-shim-runc-v2]=containerd [runc]=runc) ;;
  *) echo "usage: $0 [node]" >&2; exit 2 ;;
esac

missing=()
for bin in "${!want[@]}"; do
  if ! command -v "$bin" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$bin" ] && [ ! -x "/sbin/$bin" ]; then
    missing+=("${want[$bin]}")
  fi
done

if [ "${AMBIENTD_APT_UPDATE:-}" = "always" ] || [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "deps: missing packages (${missing[*]:-none}) and not root: run 'sudo $0'" >&2
    exit 1
  fi
  pkgs=$(printf '%s\n' "${want[@]}" | sort -u | tr '\n' ' ')
  echo "deps: apt-get install $pkgs"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $pkgs >/dev/null
fi

# Kernel modules the rules use; harmless when built in or already loaded.
for m in ip_tables ip6_tables iptable_nat iptable_mangle iptable_raw ip6table_nat ip6table_mangle ip6table_raw \
         nf_tables nft_compat xt_REDIRECT xt_owner xt_mark xt_connmark xt_CT xt_set ip_set ip_set_hash_ip \
         nf_conntrack veth bridge; do
  modprobe -q "$m" 2>/dev/null || true
done
echo "deps: ok"
