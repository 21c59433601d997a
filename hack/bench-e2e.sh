#!/usr/bin/env bash
# The enrollment benchmark (test/bench): a real kube-apiserver + etcd, the
# agent, the ztunnel emulator (netns mode) and N pods through the real CNI
# chain, in a throwaway network namespace; prints a Markdown table. Pods:
# BENCH_PODS (default 100) or -pods; see `go run ./test/bench -h`. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "bench-e2e: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make bench-e2e}" bench-e2e
mkdir -p .cache/bench
go build -o .cache/bench/ambientd-bench ./test/bench

export AMBIENTD_E2E_RUN="bench-$$-$(date +%s)"
set +e
.cache/bench/ambientd-bench "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "bench-e2e: FAIL: the benchmark left things behind (see above)" >&2; rc=1; }
exit "$rc"
