package nodeready

import (
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/ambientd/ambientd/settings"
)

// Config says what the controller maintains. NodeName is required; the
// rest defaults as documented on each field.
type Config struct {
	// NodeName is the only Node the controller reads or writes.
	NodeName string
	// ConditionType is the node condition maintained (DefaultConditionType).
	ConditionType string
	// Untaint removes the taint TaintKey (any effect) while the condition
	// is True.
	Untaint bool
	// TaintKey is the startup taint (DefaultTaintKey), under one of
	// MeshTaintPrefixes.
	TaintKey string
	// TaintWhenUnready adds TaintKey:NoSchedule back once the condition has
	// been False for TaintGracePeriod, and removes it when True again.
	TaintWhenUnready bool
	// TaintGracePeriod (DefaultGracePeriod; 0 means the default).
	TaintGracePeriod time.Duration
	// ResyncPeriod is how often the inputs are re-evaluated without a
	// Notify (DefaultResyncPeriod).
	ResyncPeriod time.Duration
	// HeartbeatPeriod is how often the condition's lastHeartbeatTime is
	// refreshed when nothing changed (DefaultHeartbeatPeriod), so a
	// condition left by an agent that died reads stale.
	HeartbeatPeriod time.Duration
	// Settle is how long a False condition (or a new reason while False)
	// must hold before it is written; True is written at once. An agent's
	// start walks through several False reasons in a second (caches,
	// ztunnel, snapshot) before True: each would be a Node write fanned
	// out to every Node watcher, and an Event. 0 writes at once (the flag
	// defaults to DefaultSettle).
	Settle time.Duration
	// AnnouncedElsewhere are condition reasons whose outages another
	// component announces with Events of its own (the agent's
	// ZtunnelUnavailable / ZtunnelAvailable, which count the pods): a
	// turn to False for one of them, and the turn back to True, record no
	// AmbientNotReady / AmbientReady, so an outage is one Event on the
	// node each way, not two (docs/scale.md). Set by the daemon, no flag.
	AnnouncedElsewhere []string
}

func (c Config) withDefaults() Config {
	if c.ConditionType == "" {
		c.ConditionType = DefaultConditionType
	}
	if c.TaintKey == "" {
		c.TaintKey = DefaultTaintKey
	}
	if c.TaintGracePeriod == 0 {
		c.TaintGracePeriod = DefaultGracePeriod
	}
	if c.ResyncPeriod == 0 {
		c.ResyncPeriod = DefaultResyncPeriod
	}
	if c.HeartbeatPeriod == 0 {
		c.HeartbeatPeriod = DefaultHeartbeatPeriod
	}
	return c
}

// Validate checks c (after defaults); each error starts with the flag
// that sets the field (RegisterFlags) and the value. Fields are checked in
// a fixed order, so with several bad ones the same is reported every time.
func (c Config) Validate() error {
	c = c.withDefaults()
	bad := func(flag, format string, args ...any) error {
		return fmt.Errorf("--"+flag+" "+format, args...)
	}
	if c.NodeName == "" {
		return bad("node-name", "is required")
	}
	if errs := validation.IsDNS1123Subdomain(c.NodeName); len(errs) > 0 {
		return bad("node-name", "%q: %v", c.NodeName, errs)
	}
	if errs := validation.IsQualifiedName(c.ConditionType); len(errs) > 0 {
		return bad("node-condition-type", "%q: %v", c.ConditionType, errs)
	}
	if errs := validation.IsQualifiedName(c.TaintKey); len(errs) > 0 {
		return bad("taint-key", "%q: %v", c.TaintKey, errs)
	}
	if !slices.ContainsFunc(MeshTaintPrefixes, func(p string) bool { return strings.HasPrefix(c.TaintKey, p) }) {
		return bad("taint-key", "%q: want one of the mesh's own prefixes %v (the agent removes this taint: a key such as dedicated would let it attract workloads that were kept away)", c.TaintKey, MeshTaintPrefixes)
	}
	// Shorter than a second, a ztunnel restart would taint the node.
	if c.TaintGracePeriod < time.Second || c.TaintGracePeriod > time.Hour {
		return bad("taint-grace-period", "%v: want 1s to 1h", c.TaintGracePeriod)
	}
	if c.ResyncPeriod < 100*time.Millisecond || c.ResyncPeriod > time.Hour {
		return bad("node-condition-resync", "%v: want 100ms to 1h", c.ResyncPeriod)
	}
	if c.Settle < 0 || (c.Settle > 0 && c.Settle < 100*time.Millisecond) || c.Settle > time.Minute {
		return bad("node-condition-settle", "%v: want 0 (at once) or 100ms to 1m", c.Settle)
	}
	if c.HeartbeatPeriod < time.Second || c.HeartbeatPeriod > time.Hour {
		return bad("node-condition-heartbeat", "%v: want 1s to 1h", c.HeartbeatPeriod)
	}
	return nil
}

// RegisterFlags binds c's fields to their flags on fs, with the defaults
// as values (NodeName is the agent's --node-name: the caller copies it).
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.ConditionType, "node-condition-type", DefaultConditionType, "node condition the agent maintains: True when the CNI plugin is installed, caches are synced and ztunnel is connected with its snapshot acked")
	fs.BoolVar(&c.Untaint, "untaint", false, "remove the startup taint (--taint-key, any effect) from this node while the node condition is True")
	fs.StringVar(&c.TaintKey, "taint-key", DefaultTaintKey, "the node's startup taint")
	fs.BoolVar(&c.TaintWhenUnready, "taint-when-unready", false, "add the taint (NoSchedule) back when the node condition has been False for --taint-grace-period, and remove it when True again")
	// 0 is "the default" to a caller in Go; on the command line it would
	// be a request for no grace at all.
	c.TaintGracePeriod = DefaultGracePeriod
	fs.Var(settings.Positive{P: &c.TaintGracePeriod}, "taint-grace-period", "how long (a `duration`) the node condition must be False before --taint-when-unready taints the node")
	fs.DurationVar(&c.ResyncPeriod, "node-condition-resync", DefaultResyncPeriod, "how often the node condition's inputs are re-evaluated besides on changes")
	fs.DurationVar(&c.HeartbeatPeriod, "node-condition-heartbeat", DefaultHeartbeatPeriod, "how often the node condition is rewritten when nothing changed, moving its lastHeartbeatTime (a condition whose heartbeat is older was left by an agent that stopped)")
	fs.DurationVar(&c.Settle, "node-condition-settle", DefaultSettle, "how long a False node condition (or a new reason while False) must hold before it is written; True is written at once (an agent's start walks several False reasons in a second: one Node write, not five; 0 = at once)")
}
