#!/usr/bin/env bash
# The soak under faults (test/soak, docs/soak.md): the end-to-end
# environment in a throwaway network namespace, pods churning and faults
# injected for SOAK_DURATION (default 2m) with about SOAK_PODS (24) pods,
# seeded by SOAK_SEED (1); an invariant sampler judges every pod. Prints the
# summary and `soak: <pods> pods, <faults> faults, <samples> samples,
# <violations> violations` last; the summary and the timeline go to SOAK_OUT
# (.cache/soak): the soak writes timeline.json, test/soakplot (a test-only
# module of its own: the plotting library stays out of the product's go.mod)
# draws timeline.png and timeline.svg from it. Exits 1 on any violation,
# leftover or a timeline that cannot be drawn. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "soak: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make soak}" soak
mkdir -p .cache/soak
go build -o .cache/soak/ambientd-soak ./test/soak
(cd test/soakplot && go build -o ../../.cache/soak/soakplot .)
# The program's -out flag overrides SOAK_OUT; then draw its timeline with
# `cd test/soakplot && go run . DIR`.
export SOAK_OUT="${SOAK_OUT:-.cache/soak}"
rm -f "$SOAK_OUT/timeline.json"

export AMBIENTD_E2E_RUN="soak-$$-$(date +%s)"
set +e
.cache/soak/ambientd-soak "$@"
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" >/dev/null || { echo "soak: FAIL: the soak left things behind (see above)" >&2; rc=1; }
# The timeline of a run that got as far as writing it (with a violation
# too: the picture shows where).
if [ -f "$SOAK_OUT/timeline.json" ]; then
  .cache/soak/soakplot "$SOAK_OUT" || { echo "soak: FAIL: the timeline in $SOAK_OUT cannot be drawn" >&2; rc=1; }
fi
exit "$rc"
