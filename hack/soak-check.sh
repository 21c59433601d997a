#!/usr/bin/env bash
# make soak-check: the soak package's tests (test/soak, docs/soak.md) — the
# 60-second soak with a fixed seed that fails on any violation, and the proof
# that the sampler catches a bypass (drift pass off, rules wiped). Checks
# that the run left nothing behind. Needs root. SOAK_AGENT_TAGS=<tags> runs
# TestSoak alone against an agent built with those tags (a known-bad build,
# e.g. ambientd_trust_restored: it must fail).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "soak-check: needs root (network namespaces, bridge, iptables); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make soak-check}" soak-check
export AMBIENTD_E2E_RUN="soak-check-$$-$(date +%s)"
run=()
if [ -n "${SOAK_AGENT_TAGS:-}" ]; then
  # A known-bad agent built on purpose (docs/soak.md, "Proving the soak
  # fails"): TestSoak alone runs it, and must fail.
  mkdir -p .cache/soak
  export SOAK_AGENT_BIN="$PWD/.cache/soak/ambientd-${SOAK_AGENT_TAGS//,/-}"
  go build -tags "grpcnotrace,$SOAK_AGENT_TAGS" -o "$SOAK_AGENT_BIN" ./cmd/ambientd
  echo "soak-check: TestSoak against $SOAK_AGENT_BIN (tags $SOAK_AGENT_TAGS)" >&2
  run=(-run 'TestSoak$')
fi
set +e
go test -tags e2e -count=1 -v -timeout 20m "${run[@]}" ./test/soak/
rc=$?
set -e
hack/leftovers.sh "$AMBIENTD_E2E_RUN" || { echo "soak-check: FAIL: the run left things behind (see above)" >&2; rc=1; }
exit "$rc"
