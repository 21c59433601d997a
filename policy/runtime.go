package policy

import (
	"fmt"
	"slices"
	"strings"
)

// NoRuntimeClass stands, in a list of capturable runtime handlers, for the
// pods that name no RuntimeClass: they run under the container runtime's
// default handler, whose name the API does not show.
const NoRuntimeClass = "default"

// DefaultCapturableRuntimeHandlers are the runtime handlers whose pods'
// traffic passes through the pod's network namespace, where the in-pod
// rules capture it: the OCI runtimes that run containers as host processes
// in that namespace (runc, crun), and the runtime's default handler for
// pods without a RuntimeClass. Sandboxed runtimes — gVisor (runsc) and
// Kata Containers (kata, kata-qemu, kata-clh, kata-fc, ...) — are not in
// it: they run the pod behind a network stack of their own (gVisor's
// netstack, the VM's kernel) that the namespace's netfilter hooks never
// see.
func DefaultCapturableRuntimeHandlers() []string {
	return []string{NoRuntimeClass, "runc", "crun"}
}

// UncapturableRuntimeError says why a pod that belongs in the mesh cannot
// be enrolled: the runtime handler it runs under is not one whose traffic
// the in-pod rules are known to capture. The pod must not be reported in
// the mesh.
type UncapturableRuntimeError struct {
	// RuntimeClass is the pod's spec.runtimeClassName ("" for none).
	RuntimeClass string
	// Handler is the RuntimeClass's handler; "" when the RuntimeClass
	// does not exist (Missing) or the pod names none.
	Handler string
	// Missing: the pod names a RuntimeClass the API does not have, so its
	// handler cannot be known.
	Missing bool
	// Capturable is the list the handler was checked against.
	Capturable []string
}

func (e *UncapturableRuntimeError) Error() string {
	var what string
	switch {
	case e.RuntimeClass == "":
		what = "the pod names no RuntimeClass and the runtime's default handler (\"" + NoRuntimeClass + "\")"
	case e.Missing:
		what = fmt.Sprintf("the pod's RuntimeClass %q does not exist, so its runtime handler", e.RuntimeClass)
	default:
		what = fmt.Sprintf("the pod's RuntimeClass %q has runtime handler %q, which", e.RuntimeClass, e.Handler)
	}
	return fmt.Sprintf("%s is not among the handlers whose traffic the in-pod redirection rules capture (--capturable-runtime-handlers=%s): "+
		"a sandboxed runtime (gVisor, Kata Containers) has a network stack of its own, and the pod would bypass ztunnel while reported in the mesh. "+
		"Label the pod istio.io/dataplane-mode=none to run it outside the mesh",
		what, strings.Join(e.Capturable, ","))
}

// CheckRuntime returns nil when a pod that names RuntimeClass class (""
// for none) with runtime handler handler may be enrolled: its handler (or
// NoRuntimeClass for a pod without a RuntimeClass) is in
// c.CapturableRuntimeHandlers. Otherwise it returns an
// *UncapturableRuntimeError. missing says the named RuntimeClass does not
// exist: its handler cannot be known, so the pod is not enrolled.
func (c Config) CheckRuntime(class, handler string, missing bool) error {
	key := handler
	if class == "" {
		key, missing = NoRuntimeClass, false
	}
	if !missing && slices.Contains(c.CapturableRuntimeHandlers, key) {
		return nil
	}
	return &UncapturableRuntimeError{RuntimeClass: class, Handler: handler, Missing: missing, Capturable: c.CapturableRuntimeHandlers}
}
