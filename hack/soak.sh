#!/usr/bin/env bash
# The soak under faults (test/soak, docs/soak.md): the end-to-end
# environment in a throwaway network namespace, pods churning and faults
# injected for SOAK_DURATION (default 2m) with about SOAK_PODS (24) pods,
# seeded by SOAK_SEED (1); an invariant sampler judges every pod. Prints the
# summary and `soak: <pods> pods, <faults> faults, <samples> samples,
# <violations> violations` last; the summary and the timeline plot go to
# SOAK_OUT (.cache/soak). Exits 1 on any violation or leftover. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "soak: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make soak}" soak
mkdir -p .cache/soak
go build -o .cache/soak/ambientd-soak ./test/soak

export AMBIENTD_E2E_RUN="soak-$$-$(date +%s)"
set +e
.cache/soak/ambientd-soak "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "soak: FAIL: the soak left things behind (see above)" >&2; rc=1; }
exit "$rc"
