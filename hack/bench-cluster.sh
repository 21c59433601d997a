#!/usr/bin/env bash
# The many-node benchmark of the control plane's cost (test/benchcluster,
# docs/scale.md "What a node costs the control plane"): BENCH_AGENTS hollow
# nodes (default 100), each with its own network namespace, agent and
# ztunnel emulator, against one real kube-apiserver + etcd, in a throwaway
# network namespace; prints Markdown tables. Settings: `go run
# ./test/benchcluster -h` (every flag has a BENCH_* variable). Needs root.
# Checks that the run left nothing behind.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "bench-cluster: needs root (network namespaces, veths, nftables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make bench-cluster}" bench-cluster
mkdir -p .cache/bench
go build -o .cache/bench/ambientd-bench-cluster ./test/benchcluster

export AMBIENTD_E2E_RUN="bench-cluster-$$-$(date +%s)"
set +e
.cache/bench/ambientd-bench-cluster "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "bench-cluster: FAIL: the benchmark left things behind (see above)" >&2; rc=1; }
exit "$rc"
