package main

import (
	"errors"
	"flag"
	"fmt"

	"github.com/ambientd/ambientd/nodeagent/nodeready"
)

// nodeReadyFlags registers the node readiness settings on fs, each with an
// environment variable, and returns the function to call after fs.Parse:
// it applies the environment to the flags not given on the command line
// (flags win, as for every other setting), and returns the validated
// nodeready.Config for nodeName.
//
// Wiring in parseRunFlags:
//
//	nodeReady := nodeReadyFlags(fs) // before fs.Parse
//	...
//	f.nodeReady, err = nodeReady(getenv, f.nodeName) // after the env loop
func nodeReadyFlags(fs *flag.FlagSet) func(getenv func(string) string, nodeName string) (nodeready.Config, error) {
	var c nodeready.Config
	fs.StringVar(&c.ConditionType, "node-condition-type", nodeready.DefaultConditionType, "node condition the agent maintains: True when the CNI plugin is installed, caches are synced and ztunnel is connected with its snapshot acked")
	fs.BoolVar(&c.Untaint, "untaint", false, "remove the startup taint (--taint-key, any effect) from this node while the node condition is True")
	fs.StringVar(&c.TaintKey, "taint-key", nodeready.DefaultTaintKey, "the node's startup taint")
	fs.BoolVar(&c.TaintWhenUnready, "taint-when-unready", false, "add the taint (NoSchedule) back when the node condition has been False for --taint-grace-period, and remove it when True again")
	fs.DurationVar(&c.TaintGracePeriod, "taint-grace-period", nodeready.DefaultGracePeriod, "how long the node condition must be False before --taint-when-unready taints the node")
	fs.DurationVar(&c.ResyncPeriod, "node-condition-resync", nodeready.DefaultResyncPeriod, "how often the node condition's inputs are re-evaluated besides on changes")
	fs.DurationVar(&c.HeartbeatPeriod, "node-condition-heartbeat", nodeready.DefaultHeartbeatPeriod, "how often the node condition is rewritten when nothing changed, moving its lastHeartbeatTime (a condition whose heartbeat is older was left by an agent that stopped)")
	env := map[string]string{
		"node-condition-type":      "AMBIENTD_NODE_CONDITION_TYPE",
		"untaint":                  "AMBIENTD_UNTAINT",
		"taint-key":                "AMBIENTD_TAINT_KEY",
		"taint-when-unready":       "AMBIENTD_TAINT_WHEN_UNREADY",
		"taint-grace-period":       "AMBIENTD_TAINT_GRACE_PERIOD",
		"node-condition-resync":    "AMBIENTD_NODE_CONDITION_RESYNC",
		"node-condition-heartbeat": "AMBIENTD_NODE_CONDITION_HEARTBEAT",
	}
	for name, e := range env {
		fs.Lookup(name).Usage += " (env " + e + ")"
	}
	// Config fields to the flags that set them, to name them in errors.
	flagOf := map[string]string{
		"NodeName":         "node-name",
		"ConditionType":    "node-condition-type",
		"TaintKey":         "taint-key",
		"TaintGracePeriod": "taint-grace-period",
		"ResyncPeriod":     "node-condition-resync",
		"HeartbeatPeriod":  "node-condition-heartbeat",
	}
	return func(getenv func(string) string, nodeName string) (nodeready.Config, error) {
		given := map[string]bool{}
		fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
		for name, e := range env {
			if v := getenv(e); v != "" && !given[name] {
				if err := fs.Set(name, v); err != nil {
					return nodeready.Config{}, fmt.Errorf("%s (for --%s): %w", e, name, err)
				}
			}
		}
		c.NodeName = nodeName
		if c.TaintGracePeriod == 0 {
			// 0 would mean "the default" to the controller; on the
			// command line it is a request for no grace at all.
			return nodeready.Config{}, errors.New("--taint-grace-period: must be positive")
		}
		if err := c.Validate(); err != nil {
			var se *nodeready.SettingError
			if errors.As(err, &se) && flagOf[se.Field] != "" {
				return nodeready.Config{}, fmt.Errorf("--%s: %w", flagOf[se.Field], se.Err)
			}
			return nodeready.Config{}, fmt.Errorf("node readiness: %w", err)
		}
		return c, nil
	}
}
