// Package agentdeps keeps in this module's go.mod and go.sum what Istio's
// node agent (istio.io/istio/cni/cmd/install-cni) and CNI plugin
// (istio.io/istio/cni/cmd/istio-cni) need, so `make istio-agent-image` can
// build both from this module at its pinned Istio revision. Nothing imports
// it; the oracle binary does not link it.
package agentdeps

import (
	// install-cni's main package is this and istio.io/istio/pkg/log.
	_ "istio.io/istio/cni/pkg/cmd"
	// istio-cni's main package is this, CNI's skel and version.
	_ "istio.io/istio/cni/pkg/plugin"
)
