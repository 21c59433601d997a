# ambientd — build, test and demo entry points. Every target that runs
# something first builds what it needs and is missing (hack/ensure; one table
# in test/infra/build says what each target needs), so each works alone, first,
# on a fresh clone.
GO        ?= go
PKGS      := ./...
E2E_TIMEOUT ?= 30m
ENSURE    = $(GO) run ./hack/ensure -name 'make $@'
# Every target but `test` runs the privileged tests it reaches
# (test/infra/testutil: unset, they skip with a reason; set, a missing
# privilege or tool fails them).
export AMBIENTD_PRIVILEGED := 1

.PHONY: all build deps unit test test-root verify deploy-manifests e2e e2e-node e2e-node-k8s135 e2e-switch bench bench-e2e bench-cluster bench-cluster-check soak soak-check demo generate lint check clean image image-test fresh-check istio-oracle istio-oracle-check istio-agent-image

all: build

# bin/ambientd, bin/ambientd-cni (shipped: cmd/), bin/ztunnel-emulator,
# bin/sidecar-validation, bin/multus and bin/dashboard-metrics (test
# programs: test/) (build flags: test/infra/build.Programs).
build:
	@$(ENSURE) build

deps:
	@hack/deps.sh

# The quick loop, as any user: every package's tests, cached by go (a
# second run takes seconds). Tests that need root or a built program skip,
# each with a one-line reason, unless AMBIENTD_PRIVILEGED=1 (test-root).
test:
	AMBIENTD_PRIVILEGED= $(GO) test $(PKGS)

# The old name of the quick loop.
unit: test

# Every package's tests with -race, the privileged ones included (real
# netns, iptables legacy and nft, nftables, SEQPACKET, the CNI reference
# plugins): a missing privilege or tool fails them. Then fails when fewer
# privileged tests ran than hack/test-root.sh expects (a suite that stopped
# running is caught, not counted as passing).
test-root:
	@$(ENSURE) test-root
	hack/test-root.sh
	cd test/helm && $(GO) test -count=1 ./...

# The manifests of deploy/ from the Helm chart deploy/helm/ambientd (their
# one source; test/helm fails when they differ).
deploy-manifests:
	cd test/helm && $(GO) run ./cmd/deploy-manifests -deploy ../../deploy

# End-to-end: real kube-apiserver + etcd, the real CNI chain, the agent.
e2e:
	E2E_TIMEOUT=$(E2E_TIMEOUT) hack/e2e.sh

# The real node: kubelet, containerd + runc, kube-controller-manager and
# kube-scheduler on the e2e control plane (docs/realnode.md).
# E2E_NODE_KUBE_VERSION=1.35: on an older Kubernetes, the readiness steps.
e2e-node:
	E2E_TIMEOUT=$(E2E_TIMEOUT) E2E_NODE_KUBE_VERSION=$(E2E_NODE_KUBE_VERSION) hack/e2e-node.sh

# The readiness steps on a real node of Kubernetes 1.35, where the chart's
# webhook adds the readiness gate (hack/kube-1.35; docs/realnode.md).
e2e-node-k8s135:
	@$(MAKE) --no-print-directory e2e-node E2E_NODE_KUBE_VERSION=1.35

bench:
	@$(ENSURE) bench
	$(GO) test -run '^$$' -bench . -benchmem -count=1 $(PKGS)

# Enrollment benchmark on the real control plane and CNI chain (root):
# BENCH_PODS=300 make bench-e2e; results go in docs/bench/.
bench-e2e:
	hack/bench-e2e.sh

# What N agents cost one API server (root): BENCH_AGENTS hollow nodes (100),
# each its own netns, agent and ztunnel emulator, against one real
# kube-apiserver + etcd; phases: steady state, rolling restart, apiserver
# restart, pod churn, ztunnel outage (BENCH_STEADY, BENCH_SETTLE,
# BENCH_AFTER_APISERVER, BENCH_CHURN, BENCH_OUTAGE, …: docs/scale.md).
bench-cluster:
	hack/bench-cluster.sh

# Its short version, in check: 10 agents, short phases (about 3 minutes);
# fails unless every agent is ready, every phase has numbers and the steady
# state costs no request but watches.
bench-cluster-check:
	@$(ENSURE) bench-cluster-check
	ENSURE_NAME='make bench-cluster-check' hack/bench-cluster.sh -check -agents 10 -start-batch 10 -steady 30s -settle 5s -after-apiserver 10s -churn 15s -churn-nodes 3 -outage 15s

# The agent image as an OCI archive (bin/ambientd-image.tar), without Docker:
# Debian packages + both binaries, assembled by hack/mkimage. Reproducible.
image:
	@$(ENSURE) image

# Builds the image twice (same digest), imports it into a throwaway
# containerd and runs ambientd and both iptables variants from it.
image-test:
	@$(ENSURE) image-test
	$(GO) test -tags e2e -count=1 -timeout 30m -v ./test/image/

# The main job: a local demo of real enrollment on a real node (kubelet,
# containerd, the DaemonSet from deploy/, the ztunnel emulator).
demo:
	@hack/demo.sh

# The soak under faults (docs/soak.md): pod churn and random faults on the
# e2e environment, judged by an invariant sampler; fails on any violation.
# Its timeline is drawn by test/soakplot (a test-only module: gonum/plot).
# SOAK_DURATION=30m SOAK_PODS=24 SOAK_SEED=1 make soak
soak:
	hack/soak.sh

# The 60-second soak of check (fixed seed; fails on any violation) and the
# proofs that its sampler catches a bypass (drift pass off, rules wiped), a
# pod Ready with no ztunnel and a mesh pod started without an agent.
soak-check:
	hack/soak-check.sh

# Each target above run alone in a fresh copy of the tree with an empty
# .cache/ builds everything its program needs (hack/fresh-check.sh). It proves
# the Makefile, not a change: .ci/run runs it after make check.
fresh-check:
	hack/fresh-check.sh

# Istio's own code as the oracle for sidecar mode: test/istio-oracle is a
# separate test-only module pinned to one Istio release (never part of ./...,
# never imported by the product). Regenerates the committed golden files in
# test/istio-oracle/testdata/sidecar and fails if any differs; also builds
# bin/istio-validation (Istio's istio-validation check), and regenerates
# testdata/metrics/istio-cni.prom, the exposition of Istio's istio-cni
# metrics that nodeagent/istiometrics is checked against. CI's other
# targets only read the committed files and never build Istio.
istio-oracle:
	cd test/istio-oracle && $(GO) build -o ../../bin/ . ./cmd/istio-validation ./cmd/istio-cni-metrics
	cd test/istio-oracle && ../../bin/istio-oracle -out testdata/sidecar
	cd test/istio-oracle && ../../bin/istio-cni-metrics -out testdata/metrics/istio-cni.prom

# The oracle check: builds the oracle and regenerates/compares the golden
# files (istio-oracle above), then runs the sidecar tests against them and
# the tests that need Istio's own istio-validation binary: Istio's check and
# ours agree (pass/fail) on the same namespaces (root); and Istio's untaint
# controller and bug-report find the chart's agent pods (findsagent). Not
# part of `check`: only this target and istio-oracle build Istio
# (docs/sidecar.md, CI budget).
istio-oracle-check: istio-oracle
	ISTIO_VALIDATION=$(CURDIR)/bin/istio-validation $(GO) test -tags istiooracle -count=1 -v -run 'Istio|Sidecar|Decision|Rules' ./nodeagent/sidecar/
	cd test/istio-oracle && $(GO) test -count=1 ./findsagent/

# Istio's own node agent (install-cni + istio-cni) as an image archive,
# bin/istio-agent-image.tar: compiled from test/istio-oracle's pinned Istio on
# the Debian layer of `make image`. Cold it costs the oracle module's cold
# build (~10 CPU-minutes); only e2e-switch needs it.
istio-agent-image:
	hack/istio-agent-image.sh

# Switching a live node between Istio's node agent and ambientd, both ways,
# Istio's iptables default and its native nftables mode, on the real node
# (docs/realnode.md). Builds Istio's agent first, so it is not part of check.
e2e-switch:
	E2E_TIMEOUT=$(E2E_TIMEOUT) hack/e2e-switch.sh

generate:
	@command -v protoc >/dev/null || hack/deps.sh
	hack/generate.sh

# The shipped code's packages (what sloglint holds to docs/agent.md's log
# schema).
SHIPPED   := ./admission/... ./cmd/... ./cniapi/... ./cniinstall/... ./cniplugin/... ./iptables/... ./nodeagent/... ./policy/... ./podmeta/... ./settings/... ./ztunnelproto/...

# gofmt, go vet with every build tag, staticcheck, sloglint (its single
# checker with the log schema built in: hack/sloglint) and the docs check
# (docs/links_test.go: every relative link in README.md and docs/ leads to a
# file and heading that exist, and every repository path the docs name
# exists; docs/testsize_test.go: no _test.go file over 600 lines). About a
# minute warm.
verify:
	@$(ENSURE) verify
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) test -count=1 ./docs/
	$(GO) vet $(PKGS)
	$(GO) vet -tags e2e ./test/...
	$(GO) vet -tags e2enode ./test/...
	$(GO) vet -tags istiooracle ./nodeagent/sidecar/
	$(GO) vet -tags ambientd_trust_restored ./nodeagent/agent/
	$(GO) vet -tags ambientd_absent_admit ./cniplugin/
	$(GO) vet -tags ambientd_absent_refuse ./cniplugin/
	cd test/helm && $(GO) vet ./...
	cd test/soakplot && $(GO) vet ./...
	$(GO) tool staticcheck $(PKGS)
	$(GO) run ./hack/sloglint -test=false $(SHIPPED)

# The old name of verify.
lint: verify

# The README's test command: everything CI checks, one target after the
# other, each one's wall time printed (docs/bench/README.md).
CHECK_TARGETS := verify test-root e2e soak-check bench-cluster-check e2e-node image-test
check:
	@for t in $(CHECK_TARGETS); do s=$$(date +%s); $(MAKE) --no-print-directory $$t || exit 1; echo "check: make $$t took $$(( $$(date +%s) - s ))s"; done

clean:
	rm -rf bin
