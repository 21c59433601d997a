package main

import (
	"errors"
	"flag"
	"fmt"

	"github.com/ambientd/ambientd/nodeagent/nodeready"
)

// nodeReadyEnvOf maps the node readiness flags to their environment
// variables.
var nodeReadyEnvOf = flagEnv{
	"node-condition-type":      "AMBIENTD_NODE_CONDITION_TYPE",
	"untaint":                  "AMBIENTD_UNTAINT",
	"taint-key":                "AMBIENTD_TAINT_KEY",
	"taint-when-unready":       "AMBIENTD_TAINT_WHEN_UNREADY",
	"taint-grace-period":       "AMBIENTD_TAINT_GRACE_PERIOD",
	"node-condition-resync":    "AMBIENTD_NODE_CONDITION_RESYNC",
	"node-condition-heartbeat": "AMBIENTD_NODE_CONDITION_HEARTBEAT",
	"node-condition-settle":    "AMBIENTD_NODE_CONDITION_SETTLE",
}

// nodeReadyFlags registers the node readiness settings on fs (their
// variables: nodeReadyEnvOf) and returns the function to call once fs is
// parsed (parseFlags): it returns the validated nodeready.Config for
// nodeName.
//
// Wiring in parseRunFlags:
//
//	nodeReady := nodeReadyFlags(fs) // before parseFlags(..., nodeReadyEnvOf)
//	...
//	f.node.NodeReady, err = nodeReady(f.node.Agent.NodeName)
func nodeReadyFlags(fs *flag.FlagSet) func(nodeName string) (nodeready.Config, error) {
	var c nodeready.Config
	fs.StringVar(&c.ConditionType, "node-condition-type", nodeready.DefaultConditionType, "node condition the agent maintains: True when the CNI plugin is installed, caches are synced and ztunnel is connected with its snapshot acked")
	fs.BoolVar(&c.Untaint, "untaint", false, "remove the startup taint (--taint-key, any effect) from this node while the node condition is True")
	fs.StringVar(&c.TaintKey, "taint-key", nodeready.DefaultTaintKey, "the node's startup taint")
	fs.BoolVar(&c.TaintWhenUnready, "taint-when-unready", false, "add the taint (NoSchedule) back when the node condition has been False for --taint-grace-period, and remove it when True again")
	fs.DurationVar(&c.TaintGracePeriod, "taint-grace-period", nodeready.DefaultGracePeriod, "how long the node condition must be False before --taint-when-unready taints the node")
	fs.DurationVar(&c.ResyncPeriod, "node-condition-resync", nodeready.DefaultResyncPeriod, "how often the node condition's inputs are re-evaluated besides on changes")
	fs.DurationVar(&c.HeartbeatPeriod, "node-condition-heartbeat", nodeready.DefaultHeartbeatPeriod, "how often the node condition is rewritten when nothing changed, moving its lastHeartbeatTime (a condition whose heartbeat is older was left by an agent that stopped)")
	fs.DurationVar(&c.Settle, "node-condition-settle", nodeready.DefaultSettle, "how long a False node condition (or a new reason while False) must hold before it is written; True is written at once (an agent's start walks several False reasons in a second: one Node write, not five; 0 = at once)")
	// Config fields to the flags that set them, to name them in errors.
	flagOf := map[string]string{
		"NodeName":         "node-name",
		"ConditionType":    "node-condition-type",
		"TaintKey":         "taint-key",
		"TaintGracePeriod": "taint-grace-period",
		"ResyncPeriod":     "node-condition-resync",
		"HeartbeatPeriod":  "node-condition-heartbeat",
		"Settle":           "node-condition-settle",
	}
	return func(nodeName string) (nodeready.Config, error) {
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
