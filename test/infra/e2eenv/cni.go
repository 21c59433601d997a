package e2eenv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/test/infra/multusemu"
)

// CNIVersion is the spec version of the chain's configuration.
const CNIVersion = "1.1.0"

// ChainConfig describes the CNI chain: bridge (IPAM host-local) and, when
// AmbientPlugin is set, our plugin last. Loopback runs as its own network on
// "lo", as container runtimes do.
type ChainConfig struct {
	// BinDirs are searched for plugin binaries, in order.
	BinDirs []string
	// Dir holds the conflist (conf/), libcni's result cache (cache/) and
	// host-local's leases (ipam/) — never the machine's /var/lib/cni.
	Dir string
	// NetworkName of the conflist (default "e2e").
	NetworkName string
	// ConfFile names the conflist file in Dir/conf (default
	// "10-<NetworkName>.conflist"). Two chains may share Dir, bridge and
	// network name (and so host-local's leases) with different conf files.
	ConfFile string
	// Bridge is the bridge device in the node netns (default "ambe2e0").
	Bridge string
	// Subnet host-local assigns from (default 10.88.0.0/24); the bridge
	// gets the first address as gateway.
	Subnet netip.Prefix
	// Subnet6, when set, is a second host-local range (IPv6): pods get
	// both families (dual-stack) and an IPv6 default route.
	Subnet6 netip.Prefix
	// AmbientPlugin is our plugin's entry, appended last; nil leaves it out.
	// See AmbientPluginConf.
	AmbientPlugin map[string]any
	// RuntimeConfDir, when set, makes the chain a container runtime's CNI
	// setup: every ADD, DEL and CHECK runs the config the runtime would
	// choose in that dir at that moment (cniinstall.RuntimeConfig: the
	// first valid file; a single-plugin .conf as a list of one), whoever
	// wrote it, instead of the chain's own conflist (which is still written
	// to Dir/conf: copy it there to make it the node's primary).
	RuntimeConfDir string
}

// AmbientPluginConf is the chain entry for bin/ambientd-cni talking to the
// agent on agentSocket, with a bounded timeout and its log in logFile.
func AmbientPluginConf(agentSocket, logFile string) map[string]any {
	return map[string]any{
		"type":        cniapi.PluginType,
		"agentSocket": agentSocket,
		"timeout":     cniapi.DefaultPluginTimeout.String(),
		"logLevel":    "debug",
		"logFile":     logFile,
	}
}

// Chain runs the CNI chain through libcni, in the caller's network namespace
// (the node netns), against pod network namespaces.
type Chain struct {
	cfg          ChainConfig
	ConflistPath string
	CacheDir     string
	IPAMDir      string
	cni          *libcni.CNIConfig
	exec         *timedExec
}

// Attachment identifies one pod sandbox for the chain.
type Attachment struct {
	ContainerID  string // K8S_POD_INFRA_CONTAINER_ID and CNI_CONTAINERID
	NetnsPath    string
	IfName       string // default eth0
	PodName      string
	PodNamespace string
	PodUID       string
	// IP, when set, asks host-local for this address (CNI_ARGS IP=), as
	// for a pod whose sandbox keeps a static address.
	IP netip.Addr
}

// NewChain writes the conflist and returns the chain.
func NewChain(cfg ChainConfig) (*Chain, error) {
	if cfg.NetworkName == "" {
		cfg.NetworkName = "e2e"
	}
	if cfg.Bridge == "" {
		cfg.Bridge = "ambe2e0"
	}
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = netip.MustParsePrefix("10.88.0.0/24")
	}
	if cfg.ConfFile == "" {
		cfg.ConfFile = "10-" + cfg.NetworkName + ".conflist"
	}
	c := &Chain{
		cfg:          cfg,
		ConflistPath: filepath.Join(cfg.Dir, "conf", cfg.ConfFile),
		CacheDir:     filepath.Join(cfg.Dir, "cache"),
		IPAMDir:      filepath.Join(cfg.Dir, "ipam"),
	}
	for _, d := range []string{filepath.Dir(c.ConflistPath), c.CacheDir, c.IPAMDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	c.exec = newTimedExec()
	c.cni = libcni.NewCNIConfigWithCacheDir(cfg.BinDirs, c.CacheDir, c.exec)
	if err := c.SetAmbientPlugin(cfg.AmbientPlugin); err != nil {
		return nil, err
	}
	return c, nil
}

// DualStack returns a chain like c (same bridge, leases and plugin) whose
// pods also get an IPv6 address from subnet6; its conflist is confFile.
func (c *Chain) DualStack(subnet6 netip.Prefix, confFile string) (*Chain, error) {
	cfg := c.cfg
	cfg.Subnet6, cfg.ConfFile = subnet6, confFile
	return NewChain(cfg)
}

// Bridge is the bridge device's name.
func (c *Chain) Bridge() string { return c.cfg.Bridge }

// Subnet is the range host-local assigns from.
func (c *Chain) Subnet() netip.Prefix { return c.cfg.Subnet }

// SetAmbientPlugin rewrites the conflist with conf as the last plugin, or
// without our plugin when conf is nil. Pods added later use the new list.
func (c *Chain) SetAmbientPlugin(conf map[string]any) error {
	c.cfg.AmbientPlugin = conf
	b, err := json.MarshalIndent(c.conflist(conf), "", "  ")
	if err != nil {
		return err
	}
	tmp := c.ConflistPath + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, c.ConflistPath)
}

func (c *Chain) conflist(ambient map[string]any) map[string]any {
	ranges := []any{[]any{map[string]any{"subnet": c.cfg.Subnet.String()}}}
	routes := []any{map[string]any{"dst": "0.0.0.0/0"}}
	if c.cfg.Subnet6.IsValid() {
		ranges = append(ranges, []any{map[string]any{"subnet": c.cfg.Subnet6.String()}})
		routes = append(routes, map[string]any{"dst": "::/0"})
	}
	plugins := []any{
		map[string]any{
			"type":        "bridge",
			"bridge":      c.cfg.Bridge,
			"isGateway":   true,
			"ipMasq":      false,
			"hairpinMode": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"dataDir": c.IPAMDir,
				"ranges":  ranges,
				"routes":  routes,
			},
		},
	}
	if ambient != nil {
		plugins = append(plugins, ambient)
	}
	return map[string]any{
		"cniVersion": CNIVersion,
		"name":       c.cfg.NetworkName,
		"plugins":    plugins,
	}
}

func (c *Chain) load() (*libcni.NetworkConfigList, error) {
	if c.cfg.RuntimeConfDir != "" {
		return runtimeChoice(c.cfg.RuntimeConfDir)
	}
	l, err := libcni.NetworkConfFromFile(c.ConflistPath)
	if err != nil {
		return nil, fmt.Errorf("load conflist %s: %w", c.ConflistPath, err)
	}
	return l, nil
}

// runtimeChoice loads the config a runtime uses in dir.
func runtimeChoice(dir string) (*libcni.NetworkConfigList, error) {
	rc, err := cniinstall.RuntimeConfig(dir)
	if err != nil {
		return nil, fmt.Errorf("the runtime's CNI config in %s: %w", dir, err)
	}
	l, err := multusemu.ConfList(rc.Data)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", rc.Path, err)
	}
	return l, nil
}

func loopbackConf() (*libcni.PluginConfig, error) {
	return libcni.NetworkPluginConfFromBytes([]byte(`{"cniVersion":"` + CNIVersion + `","name":"loopback","type":"loopback"}`))
}

func (a Attachment) runtimeConf(ifName string) *libcni.RuntimeConf {
	rc := &libcni.RuntimeConf{
		ContainerID: a.ContainerID,
		NetNS:       a.NetnsPath,
		IfName:      ifName,
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", a.PodNamespace},
			{"K8S_POD_NAME", a.PodName},
			{"K8S_POD_INFRA_CONTAINER_ID", a.ContainerID},
			{"K8S_POD_UID", a.PodUID},
		},
	}
	if a.IP.IsValid() {
		rc.Args = append(rc.Args, [2]string{"IP", a.IP.String()})
	}
	return rc
}

func (a Attachment) ifName() string {
	if a.IfName == "" {
		return "eth0"
	}
	return a.IfName
}

// Add runs ADD: loopback on lo, then the conflist on eth0. An error from a
// plugin is returned as is (a *types.Error from the failing plugin, so tests
// can read its code and message), wrapped with where it happened.
func (c *Chain) Add(ctx context.Context, a Attachment) (*current.Result, error) {
	lo, err := loopbackConf()
	if err != nil {
		return nil, err
	}
	if _, err := c.cni.AddNetwork(ctx, lo, a.runtimeConf("lo")); err != nil {
		return nil, fmt.Errorf("CNI ADD loopback for %s/%s: %w", a.PodNamespace, a.PodName, err)
	}
	list, err := c.load()
	if err != nil {
		return nil, err
	}
	res, err := c.cni.AddNetworkList(ctx, list, a.runtimeConf(a.ifName()))
	if err != nil {
		return nil, fmt.Errorf("CNI ADD %s (%s) for %s/%s: %w", list.Name, pluginTypes(list), a.PodNamespace, a.PodName, err)
	}
	cur, err := current.NewResultFromResult(res)
	if err != nil {
		return nil, fmt.Errorf("CNI ADD result for %s/%s: %w", a.PodNamespace, a.PodName, err)
	}
	return cur, nil
}

// Del runs DEL through the conflist, then loopback. Like a runtime, it is
// meant to succeed when repeated or when the netns is already gone.
func (c *Chain) Del(ctx context.Context, a Attachment) error {
	list, err := c.load()
	if err != nil {
		return err
	}
	if err := c.cni.DelNetworkList(ctx, list, a.runtimeConf(a.ifName())); err != nil {
		return fmt.Errorf("CNI DEL %s (%s) for %s/%s: %w", list.Name, pluginTypes(list), a.PodNamespace, a.PodName, err)
	}
	lo, err := loopbackConf()
	if err != nil {
		return err
	}
	if err := c.cni.DelNetwork(ctx, lo, a.runtimeConf("lo")); err != nil {
		return fmt.Errorf("CNI DEL loopback for %s/%s: %w", a.PodNamespace, a.PodName, err)
	}
	return nil
}

// Check runs CHECK through the conflist.
func (c *Chain) Check(ctx context.Context, a Attachment) error {
	list, err := c.load()
	if err != nil {
		return err
	}
	if err := c.cni.CheckNetworkList(ctx, list, a.runtimeConf(a.ifName())); err != nil {
		return fmt.Errorf("CNI CHECK %s for %s/%s: %w", list.Name, a.PodNamespace, a.PodName, err)
	}
	return nil
}

// Leases returns the addresses host-local currently has handed out, read
// from its data directory (one file per address). Proof that DEL released one.
func (c *Chain) Leases() ([]netip.Addr, error) {
	entries, err := os.ReadDir(filepath.Join(c.IPAMDir, c.cfg.NetworkName))
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, e := range entries {
		if a, err := netip.ParseAddr(e.Name()); err == nil {
			out = append(out, a)
		}
	}
	return out, nil
}

func pluginTypes(l *libcni.NetworkConfigList) string {
	var t []string
	for _, p := range l.Plugins {
		t = append(t, p.Network.Type)
	}
	return strings.Join(t, "→")
}

// IsCNIError reports whether err carries a plugin's CNI error result and
// returns it.
func IsCNIError(err error) (*types.Error, bool) {
	var e *types.Error
	ok := errors.As(err, &e)
	return e, ok
}
