#!/usr/bin/env bash
# Runs the real-node suite (go test -tags e2enode ./test/e2enode/...) as root:
# kubelet, containerd + runc, kube-controller-manager and kube-scheduler on
# the e2e control plane, inside a throwaway node network namespace
# (test/infra/nodeenv, docs/realnode.md). Then checks that the run left nothing
# behind (hack/leftovers.sh: processes, netns, mounts, work dirs, cgroups,
# containerd shims). The test binary itself (test/infra/nodeenv, under a
# machine-wide lock) fails the run when the machine's sysctls are not restored
# or when paths containerd/kubelet hard-code appeared. Builds what is missing
# first (hack/ensure: the node's binaries, about 5 minutes cold on 2 cores once
# kube-apiserver's dependencies are in the Go build cache; bin/ and the image
# every time).
#
#   E2E_TIMEOUT=30m   go test -timeout
#   E2E_RUN=regexp    go test -run
#   E2E_PKGS=...      the packages (default ./test/e2enode/...; hack/e2e-switch.sh
#                     runs ./test/e2eswitch/... this way)
#   E2E_NODE_KUBE_VERSION=1.35
#                     the node and its apiserver on an older Kubernetes (its
#                     wrapper module hack/kube-1.35, AMBIENTD_KUBE_RELEASE):
#                     by default only the readiness steps, which hold on every
#                     release (make e2e-node-k8s135; docs/realnode.md)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${E2E_NODE_KUBE_VERSION:-}" ]; then
  export AMBIENTD_KUBE_RELEASE="$E2E_NODE_KUBE_VERSION"
  E2E_RUN="${E2E_RUN:-^TestReadinessGateWithHelmDefaults\$}"
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "e2e-node: needs root (namespaces, cgroups, containerd); run: sudo $0" >&2
  exit 1
fi

start=$(date +%s)
# The agent's image is among what it builds: the suite imports it into the
# node's containerd and runs it as deploy/'s DaemonSet.
go run ./hack/ensure -name "${ENSURE_NAME:-make e2e-node}" e2e-node
build=$(( $(date +%s) - start ))

export AMBIENTD_E2E_RUN="e2enode-$$-$(date +%s)"
args=(-tags e2enode -count=1 -v -timeout "${E2E_TIMEOUT:-30m}")
if [ -n "${E2E_RUN:-}" ]; then
  args+=(-run "$E2E_RUN")
fi

set +e
go test "${args[@]}" ${E2E_PKGS:-./test/e2enode/...}
rc=$?
set -e
suite=$(( $(date +%s) - start - build ))

hack/leftovers.sh "$AMBIENTD_E2E_RUN" || { echo "e2e-node: FAIL: the run left things behind (see above)" >&2; rc=1; }
echo "e2e-node${E2E_NODE_KUBE_VERSION:+ (Kubernetes $E2E_NODE_KUBE_VERSION)}: builds ${build}s, suite ${suite}s, exit code $rc"
exit "$rc"
