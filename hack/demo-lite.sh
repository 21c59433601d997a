#!/usr/bin/env bash
# The lite demo (make demo-lite): a real kube-apiserver + etcd, the agent (bin/ambientd), the ztunnel
# emulator and a handful of pods created through the real CNI chain, all in a
# throwaway network namespace; prints each pod's enrollment and cleans up.
# Builds what is missing first (hack/ensure). Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "demo: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make demo-lite}" demo-lite
mkdir -p .cache/demo
go build -o .cache/demo/ambientd-demo-lite ./test/demolite

export AMBIENTD_E2E_RUN="demo-$$-$(date +%s)"
set +e
.cache/demo/ambientd-demo-lite "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "demo: FAIL: the demo left things behind (see above)" >&2; rc=1; }
exit "$rc"
