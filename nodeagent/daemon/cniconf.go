package daemon

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/containernetworking/cni/libcni"
)

// DefaultCNIConfDir is where container runtimes read their CNI config.
const DefaultCNIConfDir = "/etc/cni/net.d"

// PluginInConfDir is the node condition's "plugin installed" check while
// the agent does not install the plugin itself (--install-cni=false): nil
// when the CNI config the container runtime uses — the lexically first
// valid .conf, .conflist or .json file of dir, the order containerd and
// CRI-O take them in — has a plugin of type pluginType, else an error saying
// why not. Invalid files are skipped, as the runtimes skip them.
func PluginInConfDir(dir, pluginType string) error {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		return fmt.Errorf("read CNI config dir %s: %w", dir, err)
	}
	sort.Strings(files)
	for _, f := range files {
		var types []string
		if filepath.Ext(f) == ".conflist" {
			list, err := libcni.ConfListFromFile(f)
			if err != nil {
				continue
			}
			for _, p := range list.Plugins {
				types = append(types, p.Network.Type)
			}
		} else {
			b, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			conf, err := libcni.NetworkPluginConfFromBytes(b)
			if err != nil {
				continue
			}
			types = append(types, conf.Network.Type) // a single plugin: no chain
		}
		for _, t := range types {
			if t == pluginType {
				return nil
			}
		}
		return fmt.Errorf("%s, the CNI config in use, has no %q plugin (plugins %v)", f, pluginType, types)
	}
	return fmt.Errorf("no valid CNI config in %s", dir)
}
