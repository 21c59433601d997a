// Package multusemu is a test-only double of Multus CNI's auto-config
// writer (`--multus-conf-file=auto`), the part of Multus that writes the
// node's CNI config. Multus's Go module is not served to this project, so
// this follows its source, not its code:
//
// multus-cni v4.3.0-42-g95a093235 (commit 95a0932350f0), the thin plugin's
// entrypoint cmd/thin_entrypoint/main.go as its DaemonSet
// (deployments/multus-daemonset.yml) runs it: `--multus-conf-file=auto
// --cleanup-config-on-exit=true`, conf dir = autoconfig dir. What it does:
//
//   - master: libcni.ConfFiles(dir, .conf, .conflist) — sorted by name, no
//     validity check — the first whose base name does not start with
//     "00-multus.conf" (getMasterConfigPath);
//   - writes 00-multus.conflist when the master's cniVersion is >= 1.0.0,
//     else 00-multus.conf (createMultusConfig), through the temp file
//     00-multus.conf.new + rename, mode 0600: one "multus" plugin whose
//     "delegates" is the master's JSON re-encoded (json.Marshal of a map:
//     keys sorted), "capabilities" gathered from the master's plugins,
//     "logToStderr": false unless logging to stderr (default true: absent),
//     "kubeconfig" = --multus-kubeconfig-file-host;
//   - every second: if the master file it last used is gone it waits for
//     it to come back (it does not choose another); otherwise it chooses the
//     master again and regenerates when that file's SHA-256 differs from
//     the last one it generated from;
//   - on exit it removes 00-multus.conf and 00-multus.conflist
//     (cleanupMultusConf).
//
// The plugin half (plugin.go, the program test/multus) follows the same
// commit's cmd/multus and pkg/multus.
//
// Does not emulate: thick mode (multus-daemon, clusterNetwork /
// defaultNetworks); the entrypoint's other modes (a given
// --multus-conf-file, no auto-config); copying the multus binary into the
// bin dir; writing the kubeconfig file with its service-account token
// (only the path goes into the config);
// NetworkAttachmentDefinitions and the pod's network-selection annotations
// (pods here have none: only the cluster network runs); the network-status
// annotation and Events; the readiness indicator file; gateway and MAC/IP
// requests; the interface-name check in the netns.
package multusemu

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/template"
	"time"

	"github.com/containernetworking/cni/libcni"
	cniversion "github.com/containernetworking/cni/pkg/version"
)

// DefaultInterval is the thin entrypoint's watch period (time.Tick(1 * time.Second)).
const DefaultInterval = time.Second

// DefaultKubeconfig is --multus-kubeconfig-file-host's default.
const DefaultKubeconfig = "/etc/cni/net.d/multus.d/multus.kubeconfig"

// Thin is Multus's thin-plugin entrypoint with auto-config.
type Thin struct {
	// Dir is the CNI conf dir (= the autoconfig dir, as deployed).
	Dir string
	// Interval between looks at the master (default 1 s, Multus's).
	Interval time.Duration
	// Kubeconfig written into the config (default Multus's).
	Kubeconfig string
	// LogFile is --multus-log-file ("logFile": the plugin's log).
	LogFile string
	// BinDir is --additional-bin-dir ("binDir": where the plugin looks for
	// its delegates before $CNI_PATH).
	BinDir string
	// CNIDir, when set, is written as "cniDir" (the plugin's cache of
	// delegates and libcni results; default /var/lib/cni/multus). The thin
	// entrypoint has no flag for it; Multus's configuration reference
	// documents the setting. Tests set it to keep the machine's /var/lib
	// clean.
	CNIDir string
	// Generated, when set, is called after every write of Multus's file.
	Generated func(path string, data []byte)

	cniVersion string // learnt from the first master, as Multus does
}

// Restarting runs one life of the entrypoint after another, as the kubelet
// runs Multus's container (restartPolicy Always). The entrypoint exits
// when a generation fails, for instance when the master it chose is
// removed before it could read it (the agent removes its owned copy once
// Multus has adopted it); its container then restarts. A life that ends in
// an error is handed to exited and followed, after backoff, by a new one
// from newThin (Multus keeps no state across restarts). The returned func
// returns nil once ctx ends.
func Restarting(newThin func() *Thin, backoff time.Duration, exited func(error)) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		for {
			err := newThin().Run(ctx)
			if ctx.Err() != nil {
				return nil
			}
			if exited != nil {
				exited(err)
			}
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
		}
	}
}

// Run is one life of the entrypoint: generate, then watch until ctx ends,
// then remove Multus's files. A "Multus restart" is Run returning and Run
// again (a new Thin: Multus keeps no state across restarts).
func (w *Thin) Run(ctx context.Context) error {
	if w.Interval <= 0 {
		w.Interval = DefaultInterval
	}
	if w.Kubeconfig == "" {
		w.Kubeconfig = DefaultKubeconfig
	}
	defer w.cleanup()
	master, hash, err := w.generate(nil)
	if err != nil {
		return fmt.Errorf("multus: failed to create multus config: %w", err)
	}
	tick := time.NewTicker(w.Interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		if _, err := os.Stat(master); errors.Is(err, os.ErrNotExist) {
			continue // "waiting for its restoration"
		}
		if master, hash, err = w.generate(hash); err != nil {
			return fmt.Errorf("multus: failed to create multus config: %w", err)
		}
	}
}

// Master is the file Multus takes as its master in dir now.
func Master(dir string) (string, error) {
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist"})
	if err != nil {
		return "", err
	}
	sort.Strings(files) // ConfFiles keeps ReadDir's (sorted) order; make it explicit
	for _, f := range files {
		if !strings.HasPrefix(filepath.Base(f), "00-multus.conf") {
			return f, nil
		}
	}
	return "", fmt.Errorf("cannot find valid master CNI config in %q", dir)
}

func (w *Thin) generate(prevHash []byte) (string, []byte, error) {
	master, err := Master(w.Dir)
	if err != nil {
		return "", nil, err
	}
	data, err := os.ReadFile(master)
	if err != nil {
		return "", nil, err
	}
	sum := sha256.Sum256(data)
	if prevHash != nil && bytes.Equal(prevHash, sum[:]) {
		return master, prevHash, nil
	}
	conf := map[string]any{}
	if err := json.Unmarshal(data, &conf); err != nil {
		return "", nil, fmt.Errorf("cannot read master CNI config json: %w", err)
	}
	v, ok := conf["cniVersion"].(string)
	if !ok {
		return "", nil, fmt.Errorf("cannot get cniVersion in master CNI config file %q", master)
	}
	if w.cniVersion != "" && v != w.cniVersion {
		return "", nil, fmt.Errorf("multus cni version is %q while master plugin cni version is %q", w.cniVersion, v)
	}
	w.cniVersion = v
	caps := map[string]bool{}
	if plugins, ok := conf["plugins"].([]any); ok {
		for _, p := range plugins {
			if pm, ok := p.(map[string]any); ok {
				if c, ok := pm["capabilities"].(map[string]any); ok {
					for k, v := range c {
						b, _ := v.(bool)
						caps[k] = b
					}
				}
			}
		}
	} else if c, ok := conf["capabilities"].(map[string]any); ok {
		for k, v := range c {
			b, _ := v.(bool)
			caps[k] = b
		}
	}
	nested := ""
	if len(caps) > 0 {
		b, _ := json.Marshal(caps)
		nested = fmt.Sprintf("\n        \"capabilities\": %s,", b)
	}
	masterJSON, err := json.Marshal(conf)
	if err != nil {
		return "", nil, err
	}
	tmpl, path := confTemplate, filepath.Join(w.Dir, "00-multus.conf")
	if ge, err := cniversion.GreaterThanOrEqualTo(v, "1.0.0"); err == nil && ge {
		tmpl, path = conflistTemplate, filepath.Join(w.Dir, "00-multus.conflist")
	}
	opts := ""
	for _, o := range []struct{ key, val string }{{"logFile", w.LogFile}, {"binDir", w.BinDir}, {"cniDir", w.CNIDir}} {
		if o.val != "" {
			opts += fmt.Sprintf("\n        %q: %q,", o.key, o.val)
		}
	}
	var out bytes.Buffer
	if err := template.Must(template.New("multus").Parse(tmpl)).Execute(&out, map[string]string{
		"CNIVersion": v, "Name": "multus-cni-network", "Capabilities": nested,
		"Kubeconfig": w.Kubeconfig, "Master": string(masterJSON), "Options": opts,
	}); err != nil {
		return "", nil, err
	}
	tmp := filepath.Join(w.Dir, "00-multus.conf.new")
	if err := os.WriteFile(tmp, out.Bytes(), 0o600); err != nil {
		return "", nil, err
	}
	if err := os.Rename(tmp, path); err != nil {
		return "", nil, err
	}
	if w.Generated != nil {
		w.Generated(path, out.Bytes())
	}
	return master, sum[:], nil
}

func (w *Thin) cleanup() {
	_ = os.Remove(filepath.Join(w.Dir, "00-multus.conf"))
	_ = os.Remove(filepath.Join(w.Dir, "00-multus.conflist"))
}

// The templates of cmd/thin_entrypoint/main.go with the optional settings
// Multus's DaemonSet leaves unset (namespace isolation, log level,
// readiness indicator) left out; log file and bin dir when set.
const conflistTemplate = `{
    "cniVersion": "{{ .CNIVersion }}",
    "name": "{{ .Name }}",
    "plugins": [ {
        "type": "multus",{{ .Capabilities }}{{ .Options }}
        "cniConf": "/host/etc/cni/multus/net.d",
        "kubeconfig": "{{ .Kubeconfig }}",
        "delegates": [
            {{ .Master }}
        ]
    }]
}
`

const confTemplate = `{
        "cniVersion": "{{ .CNIVersion }}",
        "name": "{{ .Name }}",
        "type": "multus",{{ .Capabilities }}{{ .Options }}
        "cniConf": "/host/etc/cni/multus/net.d",
        "kubeconfig": "{{ .Kubeconfig }}",
        "delegates": [
                {{ .Master }}
        ]
}
`
