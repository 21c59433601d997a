//go:build e2e

// Package e2e holds the end-to-end tests: a real kube-apiserver and etcd, the
// real CNI chain, and (in the agent's tests) bin/ambientd and
// bin/ztunnel-emulator, all inside one throwaway node network namespace.
// Run with `make e2e` (hack/e2e.sh), or directly as root:
//
//	go test -tags e2e -count=1 -v ./test/e2e/...
package e2e

import (
	"testing"

	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// testEnv is shared by every test of the package; TestMain starts it once
// (control plane start-up is the slow part) and closes it after all tests.
var testEnv *e2eenv.Env

func TestMain(m *testing.M) {
	e2eenv.Main(m, e2eenv.Options{AmbientPlugin: true}, func(e *e2eenv.Env) { testEnv = e })
}

// agentKube is the agent's own client (nodeagent/kube, what ambientd
// links) with the agent's identity from deploy/rbac.yaml.
func agentKube(t *testing.T) kube.Interface {
	t.Helper()
	c, err := kube.NewForConfig(testEnv.CP.AgentConfig)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
