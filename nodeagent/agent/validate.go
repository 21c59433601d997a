package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/ambientd/ambientd/policy"
)

// Validate checks a Config that runs on a node (the defaults of New do
// not apply: every field is as the node will use it). Each error starts
// with the flag that sets the field (RegisterFlags) and the value wrong.
// Fields are checked in a fixed order, so with several bad ones the same
// is reported every time.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("--"+field+" "+format, args...)
	}
	if c.NodeName == "" {
		return bad("node-name", "is required")
	}
	if errs := validation.IsDNS1123Subdomain(c.NodeName); len(errs) > 0 {
		return bad("node-name", "%q: %s", c.NodeName, strings.Join(errs, "; "))
	}
	// Both are read and written on the host: a relative path would
	// depend on the agent's working directory.
	for _, p := range []struct{ field, path string }{{"host-proc", c.HostProc}, {"run-dir", c.RunDir}} {
		if !filepath.IsAbs(p.path) {
			return bad(p.field, "%q: must be an absolute path", p.path)
		}
	}
	if fi, err := os.Stat(c.HostProc); err != nil || !fi.IsDir() {
		return bad("host-proc", "%q: not a readable directory: %v", c.HostProc, err)
	}
	if errs := validation.IsQualifiedName(c.PodConditionType); len(errs) > 0 {
		return bad("pod-condition-type", "%q: %s", c.PodConditionType, strings.Join(errs, "; "))
	}
	for _, n := range c.Policy.ExcludeNamespaces {
		if errs := validation.IsDNS1123Label(n); len(errs) > 0 {
			return bad("exclude-namespaces", "%q: %s", n, strings.Join(errs, "; "))
		}
	}
	if errs := validation.IsDNS1123Label(c.Policy.SystemNamespace); len(errs) > 0 {
		return bad("system-namespace", "%q: %s", c.Policy.SystemNamespace, strings.Join(errs, "; "))
	}
	// A handler name is a RuntimeClass's handler: a DNS label (as is
	// policy.NoRuntimeClass). An empty list would refuse every mesh pod.
	if len(c.Policy.CapturableRuntimeHandlers) == 0 {
		return bad("capturable-runtime-handlers", "is empty: want at least one handler (%q for pods without a RuntimeClass)", policy.NoRuntimeClass)
	}
	for _, h := range c.Policy.CapturableRuntimeHandlers {
		if errs := validation.IsDNS1123Label(h); len(errs) > 0 {
			return bad("capturable-runtime-handlers", "%q: %s", h, strings.Join(errs, "; "))
		}
	}
	if c.PodLookupTimeout < 100*time.Millisecond || c.PodLookupTimeout > 5*time.Minute {
		return bad("pod-lookup-timeout", "%v: want 100ms to 5m", c.PodLookupTimeout)
	}
	// A retry sooner than a millisecond is a hot loop; a pod whose
	// reconcile failed waits at most an hour for its next try.
	if c.RetryBaseDelay < time.Millisecond || c.RetryBaseDelay > time.Hour {
		return bad("retry-base-delay", "%v: want 1ms to 1h", c.RetryBaseDelay)
	}
	if c.RetryMaxDelay < c.RetryBaseDelay || c.RetryMaxDelay > time.Hour {
		return bad("retry-max-delay", "%v: want the base delay %v to 1h", c.RetryMaxDelay, c.RetryBaseDelay)
	}
	// 0 is the documented "never"; a positive grace longer than an hour
	// would be a silent never: pods Ready while nothing proxies them.
	if c.ZtunnelGrace < 0 || (c.ZtunnelGrace > 0 && c.ZtunnelGrace < time.Millisecond) || c.ZtunnelGrace > time.Hour {
		return bad("ztunnel-grace", "%v: want 0 (never) or 1ms to 1h", c.ZtunnelGrace)
	}
	// A drift pass more often than 100ms would be most of the agent's
	// work; less often than daily, drift would be repaired by chance.
	if c.VerifyInterval < 0 || (c.VerifyInterval > 0 && c.VerifyInterval < 100*time.Millisecond) || c.VerifyInterval > 24*time.Hour {
		return bad("verify-interval", "%v: want 0 (off) or 100ms to 24h", c.VerifyInterval)
	}
	if c.Workers < 1 || c.Workers > 256 {
		return bad("workers", "%d: want 1..256", c.Workers)
	}
	if c.MaxParallelAdds < 1 || c.MaxParallelAdds > 1024 {
		return bad("max-parallel-adds", "%d: want 1..1024", c.MaxParallelAdds)
	}
	return nil
}
