#!/usr/bin/env bash
# make soak-check: the soak package's tests (test/soak, docs/soak.md) — the
# 60-second soak with a fixed seed that fails on any violation, a run
# through an agent outage past the install lease's TTL, and the proofs that
# the sampler catches what it judges (known-bad flags and builds). Checks
# that the run left nothing behind, and draws each test's timeline
# (SOAK_OUT/<test>/timeline.png, .svg; SOAK_OUT defaults to
# .cache/soak/check) with test/soakplot after its own tests: a timeline the
# soak writes that the plotter cannot draw fails the check. Needs root. SOAK_AGENT_TAGS=<tags> runs
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
# The tests write SOAK_OUT/<test> from their package directory: absolute.
export SOAK_OUT="${SOAK_OUT:-$PWD/.cache/soak/check}"
rm -rf "$SOAK_OUT"
mkdir -p .cache/soak
(cd test/soakplot && go test -count=1 ./... && go build -o ../../.cache/soak/soakplot .)
run=()
if [ -n "${SOAK_AGENT_TAGS:-}" ]; then
  # A known-bad agent built on purpose (docs/soak.md, "Proving the soak
  # fails"): TestSoak alone runs it, and must fail.
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
for tl in "$SOAK_OUT"/*/timeline.json; do
  [ -e "$tl" ] || { echo "soak-check: FAIL: no test wrote a timeline in $SOAK_OUT" >&2; rc=1; break; }
  .cache/soak/soakplot "$(dirname "$tl")" || { echo "soak-check: FAIL: the timeline $tl cannot be drawn" >&2; rc=1; }
done
exit "$rc"
