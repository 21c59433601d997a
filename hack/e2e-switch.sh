#!/usr/bin/env bash
# Runs the switch scenarios (go test -tags e2enode ./test/e2eswitch/...) on the
# real node: Istio's own node agent (built from test/istio-oracle's pinned
# Istio by hack/istio-agent-image.sh) and ambientd's DaemonSet take the node
# over from each other while pods run (docs/realnode.md, "Switching").
# Everything else is hack/e2e-node.sh's: the node's binaries, bin/, the agent
# image, the machine-wide lock and the leftover check.
#
# Not part of `make check`: the Istio build is the oracle module's cold build
# (~10 CPU-minutes) when its caches are cold.
#
#   E2E_TIMEOUT=30m   go test -timeout
#   E2E_RUN=regexp    go test -run (e.g. 'TestSwitch/IstioNFTables')
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "e2e-switch: needs root (namespaces, cgroups, containerd); run: sudo $0" >&2
  exit 1
fi
go run ./hack/ensure -name "${ENSURE_NAME:-make e2e-switch}" e2e-switch
start=$(date +%s)
ENSURE_NAME="make e2e-switch" hack/istio-agent-image.sh
echo "e2e-switch: Istio's agent image in $(( $(date +%s) - start ))s"
E2E_PKGS=./test/e2eswitch/... ENSURE_NAME="make e2e-switch" exec hack/e2e-node.sh
