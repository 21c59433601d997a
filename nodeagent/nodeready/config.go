package nodeready

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
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

// SettingError is a Config validation error; Field names the Config field
// (so a caller can name its own flag for it).
type SettingError struct {
	Field string
	Err   error
}

func (e *SettingError) Error() string { return e.Field + ": " + e.Err.Error() }
func (e *SettingError) Unwrap() error { return e.Err }

// Validate checks c (after defaults); errors are *SettingError.
func (c Config) Validate() error {
	c = c.withDefaults()
	bad := func(field, format string, args ...any) error {
		return &SettingError{Field: field, Err: fmt.Errorf(format, args...)}
	}
	if c.NodeName == "" {
		return bad("NodeName", "node name is required")
	}
	if errs := validation.IsDNS1123Subdomain(c.NodeName); len(errs) > 0 {
		return bad("NodeName", "node name %q: %v", c.NodeName, errs)
	}
	if errs := validation.IsQualifiedName(c.ConditionType); len(errs) > 0 {
		return bad("ConditionType", "condition type %q: %v", c.ConditionType, errs)
	}
	if errs := validation.IsQualifiedName(c.TaintKey); len(errs) > 0 {
		return bad("TaintKey", "taint key %q: %v", c.TaintKey, errs)
	}
	if !slices.ContainsFunc(MeshTaintPrefixes, func(p string) bool { return strings.HasPrefix(c.TaintKey, p) }) {
		return bad("TaintKey", "taint key %q: want one of the mesh's own prefixes %v (the agent removes this taint: a key such as dedicated would let it attract workloads that were kept away)", c.TaintKey, MeshTaintPrefixes)
	}
	// Shorter than a second, a ztunnel restart would taint the node.
	if c.TaintGracePeriod < time.Second || c.TaintGracePeriod > time.Hour {
		return bad("TaintGracePeriod", "taint grace period %v: want 1s to 1h", c.TaintGracePeriod)
	}
	if c.ResyncPeriod < 100*time.Millisecond || c.ResyncPeriod > time.Hour {
		return bad("ResyncPeriod", "resync period %v: want between 100ms and 1h", c.ResyncPeriod)
	}
	if c.Settle < 0 || (c.Settle > 0 && c.Settle < 100*time.Millisecond) || c.Settle > time.Minute {
		return bad("Settle", "settle %v: want 0 (at once) or 100ms to 1m", c.Settle)
	}
	if c.HeartbeatPeriod < time.Second || c.HeartbeatPeriod > time.Hour {
		return bad("HeartbeatPeriod", "heartbeat period %v: want between 1s and 1h", c.HeartbeatPeriod)
	}
	return nil
}
