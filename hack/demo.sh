#!/usr/bin/env bash
# The main job (make demo): ambientd on a real node. kubelet, containerd +
# runc, kube-controller-manager and kube-scheduler on a real kube-apiserver +
# etcd, in a throwaway network and mount namespace (test/infra/nodeenv); the
# agent's DaemonSet from `make image` applied with `kubectl apply -k`; the
# ztunnel emulator; a Deployment with a readiness gate and a few pods. Prints
# what happened (test/demo) and removes everything. Needs root.
#
# Builds what is missing first (hack/ensure, test/infra/build): the node's
# Debian packages, etcd, kube-apiserver, kubelet, kube-controller-manager,
# kube-scheduler and kubectl from the Go module proxy (about 20 minutes on 2
# cores the first time, one line per step; then cached in .cache/kube), the
# CNI reference plugins, bin/ and the image.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "demo: needs root (namespaces, cgroups, containerd, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make demo}" demo
mkdir -p .cache/demo
go build -o .cache/demo/ambientd-demo ./test/demo

export AMBIENTD_E2E_RUN="demo-$$-$(date +%s)"
set +e
.cache/demo/ambientd-demo "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "demo: FAIL: the demo left things behind (see above)" >&2; rc=1; }
exit "$rc"
