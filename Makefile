# ambientd — build, test and demo entry points. Every target that needs system
# packages runs hack/deps.sh first, which installs only what is missing.
GO        ?= go
GOFLAGS   ?=
BIN       := bin
PKGS      := ./...
E2E_TIMEOUT ?= 30m

.PHONY: all build deps test e2e e2e-node bench bench-e2e demo demo-lite generate lint check clean image image-test

all: build

build:
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/ambientd ./cmd/ambientd
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -tags grpcnotrace -trimpath -ldflags='-s -w' -o $(BIN)/ambientd-cni ./cmd/ambientd-cni
	CGO_ENABLED=0 $(GO) build $(GOFLAGS) -o $(BIN)/ztunnel-emulator ./cmd/ztunnel-emulator

deps:
	@hack/deps.sh

# Unit tests and root integration tests (real netns, iptables, SEQPACKET).
test: deps
	$(GO) test -race -count=1 $(PKGS)

# End-to-end: real kube-apiserver + etcd, the real CNI chain, the agent.
e2e: deps build
	E2E_TIMEOUT=$(E2E_TIMEOUT) hack/e2e.sh

# The real node: kubelet, containerd + runc, kube-controller-manager and
# kube-scheduler on the e2e control plane (docs/realnode.md).
e2e-node: build
	@hack/deps.sh node
	E2E_TIMEOUT=$(E2E_TIMEOUT) hack/e2e-node.sh

bench: deps
	$(GO) test -run '^$$' -bench . -benchmem -count=1 $(PKGS)

# Enrollment benchmark on the real control plane and CNI chain (root):
# BENCH_PODS=300 make bench-e2e; results go in bench/results-<date>.md.
bench-e2e: deps build
	hack/bench-e2e.sh

# The agent image as an OCI archive (bin/ambientd-image.tar), without Docker:
# Debian packages + both binaries, assembled by hack/mkimage. Reproducible.
image: deps
	hack/image.sh

# Builds the image twice (same digest), imports it into a throwaway
# containerd and runs ambientd and both iptables variants from it.
image-test: deps
	$(GO) test -tags e2e -count=1 -timeout 30m -v ./test/image/

# The main job: a local demo of real enrollment on a real node (kubelet,
# containerd, the DaemonSet from deploy/, the ztunnel emulator).
demo: deps build
	hack/demo.sh

# The lighter demo: control plane + the CNI chain driven by libcni, no kubelet
# (builds only kube-apiserver and etcd: ~10 minutes cold instead of ~25).
demo-lite: deps build
	hack/demo-lite.sh

generate:
	@command -v protoc >/dev/null || hack/deps.sh
	PATH="$$(pwd)/$(BIN)/tools:$$PATH" hack/generate.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) vet -tags e2e ./test/...
	$(GO) vet -tags e2enode ./test/...
	$(GO) tool staticcheck $(PKGS)

# The README's test command: everything CI checks.
check: deps lint test e2e e2e-node image-test

clean:
	rm -rf $(BIN)
