#!/usr/bin/env bash
# Runs the end-to-end suite (go test -tags e2e ./test/e2e/...) as root, then
# checks that the run left nothing behind: no process of this run, no node
# network namespace, no bridge in the machine's netns, no mount, no work dir.
# Leftovers fail the run. Builds what is missing first (hack/ensure:
# kube-apiserver, etcd, the CNI reference plugins; bin/ every time).
#
#   E2E_TIMEOUT=30m   go test -timeout
#   E2E_RUN=regexp    go test -run
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" -ne 0 ]; then
  echo "e2e: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi

start=$(date +%s)
# bin/ is rebuilt every time (seconds with a warm cache): a stale agent binary
# would make the suite test old code.
go run ./hack/ensure -name "${ENSURE_NAME:-make e2e}" e2e

# Every process of this run inherits the id (e2eenv passes it down), and the
# work dirs are named after it: that is how leftovers are told apart from a
# concurrent run's.
export AMBIENTD_E2E_RUN="e2e-$$-$(date +%s)"
args=(-tags e2e -count=1 -v -timeout "${E2E_TIMEOUT:-30m}")
if [ -n "${E2E_RUN:-}" ]; then
  args+=(-run "$E2E_RUN")
fi

set +e
go test "${args[@]}" ./test/e2e/...
rc=$?
set -e
suite=$(( $(date +%s) - start ))

hack/leftovers.sh "$AMBIENTD_E2E_RUN" || { echo "e2e: FAIL: the run left things behind (see above)" >&2; rc=1; }

echo "e2e: suite finished in ${suite}s with exit code $rc"
exit "$rc"
