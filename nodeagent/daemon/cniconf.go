package daemon

import (
	"fmt"
	"slices"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
)

// PluginInConfDir is the node condition's "plugin installed" check while
// the agent does not install the plugin itself (--install-cni=false): nil
// when the CNI config the container runtime uses (cniinstall.RuntimeConfig:
// the first valid .conf, .conflist or .json file of dir, the order
// containerd and CRI-O take them in) has a plugin of type pluginType, else
// an error saying why not.
func PluginInConfDir(dir, pluginType string) error {
	rc, err := cniinstall.RuntimeConfig(dir)
	if err != nil {
		return fmt.Errorf("read CNI config dir %s: %w", dir, err)
	}
	if !slices.Contains(rc.Types, pluginType) {
		return fmt.Errorf("%s, the CNI config in use, has no %q plugin (plugins %v)", rc.Path, pluginType, rc.Types)
	}
	return nil
}

// pluginCheck is PluginInConfDir as the node condition runs it: a failure
// is explained as the installer explains its own (cniinstall.
// ExplainExclusive) when Cilium's cni-exclusive renamed configs of dir away
// since the agent started.
func pluginCheck(dir, pluginType string, started time.Time) func() error {
	return func() error {
		return cniinstall.ExplainExclusive(dir, started, PluginInConfDir(dir, pluginType))
	}
}
