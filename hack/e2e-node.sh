#!/usr/bin/env bash
# Runs the real-node suite (go test -tags e2enode ./test/e2enode/...) as root:
# kubelet, containerd + runc, kube-controller-manager and kube-scheduler on
# the e2e control plane, inside a throwaway node network namespace
# (internal/nodeenv, docs/realnode.md). Then checks that the run left nothing
# behind (hack/leftovers.sh: processes, netns, mounts, work dirs, cgroups,
# containerd shims) and that the machine's sysctls are as before. Builds what
# is missing first (hack/build-kube.sh node: about 25 minutes cold on 2 cores).
#
#   E2E_TIMEOUT=30m   go test -timeout
#   E2E_RUN=regexp    go test -run
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "e2e-node: needs root (namespaces, cgroups, containerd); run: sudo $0" >&2
  exit 1
fi

start=$(date +%s)
hack/build-kube.sh node >/dev/null
make --no-print-directory build >/dev/null
build=$(( $(date +%s) - start ))

sysctls="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward"
# shellcheck disable=SC2086
before=$(sysctl -n $sysctls | tr '\n' ' ')
# Paths containerd, libcni and kubelet hard-code; nodeenv covers them with a
# tmpfs in the node's mount namespace, so none may appear on the machine.
hardcoded="/run/containerd /var/lib/cni /var/lib/kubelet /var/log/containers /var/log/pods /etc/cni /opt/cni /var/lib/containerd /usr/libexec/kubernetes"
existing() { for p in $hardcoded; do [ -e "$p" ] && echo "$p"; done; true; }
paths_before=$(existing)

export AMBIENTD_E2E_RUN="e2enode-$$-$(date +%s)"
args=(-tags e2enode -count=1 -v -timeout "${E2E_TIMEOUT:-30m}")
if [ -n "${E2E_RUN:-}" ]; then
  args+=(-run "$E2E_RUN")
fi

set +e
go test "${args[@]}" ./test/e2enode/...
rc=$?
set -e
suite=$(( $(date +%s) - start - build ))

hack/leftovers.sh "$AMBIENTD_E2E_RUN" || { echo "e2e-node: FAIL: the run left things behind (see above)" >&2; rc=1; }
# shellcheck disable=SC2086
after=$(sysctl -n $sysctls | tr '\n' ' ')
if [ "$(existing)" != "$paths_before" ]; then
  echo "e2e-node: FAIL: paths appeared on the machine: before: [$paths_before] after: [$(existing)]" >&2
  rc=1
fi
if [ "$before" != "$after" ]; then
  echo "e2e-node: FAIL: sysctls ($sysctls) changed: before: $before after: $after" >&2
  rc=1
fi

echo "e2e-node: builds ${build}s, suite ${suite}s, exit code $rc"
exit "$rc"
