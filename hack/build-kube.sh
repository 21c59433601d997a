#!/usr/bin/env bash
# Builds the real kube-apiserver and etcd that the end-to-end tests and the demo
# run on loopback, from the Go module proxy, through the wrapper module in
# hack/kube. Output: .cache/kube/<version>/{kube-apiserver,etcd}. Does nothing
# when both binaries are already there; the Go build cache makes a rebuild in a
# fresh clone fast. Prints the output directory on stdout (last line).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

# One version string per wrapper module state: the kubernetes version plus the
# etcd version, both read from hack/kube/go.mod so bumping it rebuilds.
kube_version=$(awk '$1=="k8s.io/kubernetes"{print $2}' hack/kube/go.mod)
etcd_version=$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2}' hack/kube/go.mod)
if [ -z "$kube_version" ] || [ -z "$etcd_version" ]; then
  echo "build-kube: cannot read k8s.io/kubernetes / etcd versions from hack/kube/go.mod" >&2
  exit 1
fi
out="$root/.cache/kube/${kube_version}-etcd-${etcd_version}"

if [ -x "$out/kube-apiserver" ] && [ -x "$out/etcd" ]; then
  echo "$out"
  exit 0
fi

mkdir -p "$out"
# One build at a time (parallel test binaries and scripts may all ask): wait
# for a build in progress, then look again.
exec 9>"$root/.cache/kube/.lock"
flock 9
if [ -x "$out/kube-apiserver" ] && [ -x "$out/etcd" ]; then
  echo "$out"
  exit 0
fi
start=$(date +%s)
echo "build-kube: building kube-apiserver $kube_version and etcd $etcd_version into $out (about 10 minutes cold on 2 cores)" >&2
cd hack/kube
# -mod=readonly with the committed go.sum: the wrapper module is fully pinned.
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=readonly -buildvcs=false"
# The version the binaries report (upstream sets it the same way at release).
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$kube_version -X k8s.io/component-base/version.gitMajor=$(echo "${kube_version#v}" | cut -d. -f1) -X k8s.io/component-base/version.gitMinor=$(echo "$kube_version" | cut -d. -f2) -X k8s.io/component-base/version.gitTreeState=clean"
# Build into temporary names and rename, so an interrupted build never leaves a
# half-written binary that the check above would take for a finished one.
go build -trimpath -ldflags='-s -w' -o "$out/.etcd.tmp" ./etcd
go build -trimpath -ldflags="$ldflags" -o "$out/.kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
mv "$out/.etcd.tmp" "$out/etcd"
mv "$out/.kube-apiserver.tmp" "$out/kube-apiserver"
echo "build-kube: done in $(( $(date +%s) - start ))s" >&2
echo "$out"
