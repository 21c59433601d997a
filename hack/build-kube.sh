#!/usr/bin/env bash
# Builds the real Kubernetes binaries the tests and the demo run, from the Go
# module proxy, through the wrapper module in hack/kube, into
# .cache/kube/<version>/.
#
#   hack/build-kube.sh        kube-apiserver and etcd (the control plane: make e2e, make demo)
#   hack/build-kube.sh node   the control plane plus kubelet, kube-controller-manager,
#                             kube-scheduler and kubectl (the real node: make e2e-node)
#
# Builds only the binaries that are missing; the Go build cache makes a rebuild
# in a fresh clone fast. Prints the output directory on stdout (last line).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

want=(etcd kube-apiserver)
case "${1:-}" in
  "") ;;
  node) want+=(kubelet kube-controller-manager kube-scheduler kubectl) ;;
  *) echo "usage: $0 [node]" >&2; exit 2 ;;
esac

# One version string per wrapper module state: the kubernetes version plus the
# etcd version, both read from hack/kube/go.mod so bumping it rebuilds.
kube_version=$(awk '$1=="k8s.io/kubernetes"{print $2}' hack/kube/go.mod)
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2}' hack/kube/go.mod)
if [ -z "$kube_version" ] || [ -z "$etcd_version" ]; then
  echo "build-kube: cannot read k8s.io/kubernetes / etcd versions from hack/kube/go.mod" >&2
  exit 1
fi
out="$root/.cache/kube/${kube_version}-etcd-${etcd_version}"

missing() {
  local b
  for b in "${want[@]}"; do
    [ -x "$out/$b" ] || echo "$b"
  done
}

if [ -z "$(missing)" ]; then
  echo "$out"
  exit 0
fi

mkdir -p "$out"
cd hack/kube
# -mod=readonly with the committed go.sum: the wrapper module is fully pinned.
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"
# The version the binaries report (upstream sets it the same way at release).
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$kube_version -X k8s.io/component-base/version.gitMajor=$(echo "${kube_version#v}" | cut -d. -f1) -X k8s.io/component-base/version.gitMinor=$(echo "$kube_version" | cut -d. -f2) -X k8s.io/component-base/version.gitTreeState=clean"

# One build at a time (parallel test binaries and scripts may all ask). The
# lock is taken per binary, in the order of $want, so a script that needs only
# the control plane waits for etcd and kube-apiserver, not for the node's
# binaries someone else is building. Each binary is built into a temporary name
# and renamed, so an interrupted build never leaves a half-written binary that
# the checks take for a finished one.
exec 9>"$root/.cache/kube/.lock"
for b in "${want[@]}"; do
  [ -x "$out/$b" ] && continue
  flock 9
  if [ ! -x "$out/$b" ]; then
    start=$(date +%s)
    case "$b" in
      etcd)
        echo "build-kube: building etcd $etcd_version into $out" >&2
        go build -trimpath -ldflags='-s -w' -o "$out/.$b.tmp" ./etcd ;;
      *)
        echo "build-kube: building $b $kube_version into $out (several minutes cold on 2 cores)" >&2
        go build -trimpath -ldflags="$ldflags" -o "$out/.$b.tmp" "k8s.io/kubernetes/cmd/$b" ;;
    esac
    mv "$out/.$b.tmp" "$out/$b"
    echo "build-kube: $b done in $(( $(date +%s) - start ))s" >&2
  fi
  flock -u 9
done
echo "$out"
