#!/usr/bin/env bash
# make test-root: every package's tests with -race, the privileged ones
# asked for (AMBIENTD_PRIVILEGED=1: a missing root or tool fails them), then
# a count of the privileged tests that ran (each appends its name to
# AMBIENTD_PRIVILEGED_LOG). Fewer than MIN_PRIVILEGED fails the run: a
# suite that stopped running — skipped, not compiled, no longer asking for
# its privilege — must not pass as green. Raise the floor when you add
# privileged tests.
set -euo pipefail
cd "$(dirname "$0")/.."
MIN_PRIVILEGED=${MIN_PRIVILEGED:-300}
# The packages (the count is only meaningful for all of them).
PKGS=${TEST_ROOT_PKGS:-./...}

if [ "$(id -u)" -ne 0 ]; then
  echo "test-root: needs root (network namespaces, iptables); run: sudo make test-root" >&2
  exit 1
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
AMBIENTD_PRIVILEGED=1 AMBIENTD_PRIVILEGED_LOG="$log" go test -race -count=1 $PKGS
rc=$?
set -e
ran=$(sort -u "$log" | wc -l)
echo "test-root: $ran privileged tests ran (at least $MIN_PRIVILEGED expected)"
if [ "$ran" -lt "$MIN_PRIVILEGED" ]; then
  echo "test-root: FAIL: only $ran privileged tests ran; were they skipped?" >&2
  exit 1
fi
exit $rc
