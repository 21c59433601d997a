#!/usr/bin/env bash
# Proves that every make target that runs something works alone, first, on a
# fresh clone (make fresh-check; .ci/run runs it after make check): for each set of
# needs in test/infra/build.Targets, a fresh copy of the tree with an empty
# .cache/ runs the target's own ensure step (what its make target / script
# runs first), then each program of the targets sharing that set in check-only
# mode (AMBIENTD_CHECK_ONLY=1: the program finds everything it needs already
# built, or fails naming what is missing, and starts nothing). Go's build and
# module caches stay warm, so the Kubernetes binaries are only linked again
# (a few minutes in all). Needs root (the packages step).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scratch_root=$(mktemp -d /tmp/ambientd-fresh-XXXXXX)
trap 'rm -rf "$scratch_root"' EXIT

# fresh TARGET: a copy of the tree as git sees it (tracked and untracked,
# nothing ignored: no .cache/, no bin/), then TARGET's ensure step in it.
fresh() {
  local dir="$scratch_root/$1"
  mkdir -p "$dir"
  git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$dir"
  [ ! -e "$dir/.cache" ] && [ ! -e "$dir/bin" ] || { echo "fresh-check: $dir is not fresh" >&2; exit 1; }
  echo "fresh-check: [$1] ensure step in a fresh copy (empty .cache/)"
  (cd "$dir" && go run ./hack/ensure -name "make $1" "$1")
}

# check NAME DIR CMD...: run a program of DIR in check-only mode.
check() {
  local name=$1 dir=$2; shift 2
  echo "fresh-check: [$name] its program finds everything it needs"
  (cd "$dir" && AMBIENTD_CHECK_ONLY=1 "$@") || { echo "fresh-check: FAIL: make $name alone on a fresh clone would not find what it needs" >&2; exit 1; }
}

# The control plane set: e2e, bench-e2e, bench-cluster,
# bench-cluster-check, soak, soak-check.
fresh e2e
d="$scratch_root/e2e"
check e2e "$d" go test -tags e2e -count=1 -run '^$' ./test/e2e/
check bench-e2e "$d" go run ./test/bench
check bench-cluster "$d" go run ./test/benchcluster
check bench-cluster-check "$d" go run ./test/benchcluster -check -agents 10
check soak "$d" go run ./test/soak
check soak-check "$d" go test -tags e2e -count=1 -run '^$' ./test/soak/

# The real-node set: e2e-node, demo and e2e-switch.
fresh e2e-node
d="$scratch_root/e2e-node"
check e2e-node "$d" go test -tags e2enode -count=1 -run '^$' ./test/e2enode/
check demo "$d" go run ./test/demo
check e2e-switch "$d" go test -tags e2enode -count=1 -run '^$' ./test/e2eswitch/

# The image alone.
fresh image
d="$scratch_root/image"
# The listing is read whole before grep looks at it: grep -q in a pipe exits at
# the first match, tar then dies of SIGPIPE, and pipefail fails the check.
listing=$(tar -tf "$d/bin/ambientd-image.tar") || { echo "fresh-check: FAIL: bin/ambientd-image.tar cannot be read" >&2; exit 1; }
grep -qx 'index.json' <<<"$listing" || { echo "fresh-check: FAIL: make image alone built no OCI archive" >&2; exit 1; }
echo "fresh-check: [image] bin/ambientd-image.tar is an OCI archive"

echo "fresh-check: ok in $(( $(date +%s) - start ))s"
