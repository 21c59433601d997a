#!/usr/bin/env bash
# The main job (make demo): ambientd on a real node. kubelet, containerd +
# runc, kube-controller-manager and kube-scheduler on a real kube-apiserver +
# etcd, in a throwaway network and mount namespace (internal/nodeenv); the
# agent's DaemonSet from `make image` applied with `kubectl apply -k`; the
# ztunnel emulator; a Deployment with a readiness gate and a few pods. Prints
# what happened (test/demo) and removes everything. Needs root.
#
# Builds what is missing first: the node's Debian packages (hack/deps.sh node),
# kube-apiserver, etcd, kubelet, kube-controller-manager, kube-scheduler and
# kubectl from the Go module proxy (hack/build-kube.sh node: ~25 minutes on 2
# cores the first time, then cached in .cache/kube), bin/ and the image.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "demo: needs root (namespaces, cgroups, containerd, iptables); run: sudo $0" >&2
  exit 1
fi
hack/deps.sh node >/dev/null
if [ -z "$(find -L .cache/kube -maxdepth 2 -name kubelet 2>/dev/null | head -1)" ]; then
  echo "demo: first run: building the Kubernetes binaries from modules (~25 minutes on 2 cores, once)" >&2
fi
hack/build-kube.sh node >/dev/null
make --no-print-directory build >/dev/null
echo "demo: building the agent image (make image)" >&2
hack/image.sh >/dev/null
mkdir -p .cache/demo
go build -o .cache/demo/ambientd-demo ./test/demo

export AMBIENTD_E2E_RUN="demo-$$-$(date +%s)"
set +e
.cache/demo/ambientd-demo "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "demo: FAIL: the demo left things behind (see above)" >&2; rc=1; }
exit "$rc"
