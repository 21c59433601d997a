package nodeenv

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// containerdConfig renders containerd 1.6's config (version 2) for the node:
// all state under dir, the CRI with the workarounds this kind of machine
// needs (see docs/realnode.md): no AppArmor, oom_score_adj clamped to what
// the process may set, runc with the cgroupfs driver and its state under dir,
// the given CNI dirs with one conflist. Pod netns go to containerd's default
// /var/run/netns, a tmpfs of the node's mount namespace, where the
// DaemonSet's hostPath finds them (netns_mounts_under_state_dir would hide
// them from it).
func containerdConfig(dir, address, runc, cniBinDir, cniConfDir string) string {
	q := strconv.Quote
	return `version = 2
root = ` + q(filepath.Join(dir, "root")) + `
state = ` + q(filepath.Join(dir, "state")) + `
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = ` + q(address) + `

[ttrpc]
  address = ` + q(address+".ttrpc") + `

[plugins."io.containerd.internal.v1.opt"]
  path = ` + q(filepath.Join(dir, "opt")) + `

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = ` + q(PauseImage) + `
  disable_apparmor = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = ` + q(runc) + `
        Root = ` + q(filepath.Join(dir, "runc")) + `
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = ` + q(cniBinDir) + `
    conf_dir = ` + q(cniConfDir) + `
    max_conf_num = 1
`
}

// nodeConflist is the node's CNI chain: the reference bridge plugin (a
// gateway on the node, so kubelet reaches pods for probes) with host-local
// IPAM (leases in ipamDir). ambientd's installer appends its plugin to this
// file later.
func nodeConflist(bridge, subnet, ipamDir string) ([]byte, error) {
	return primaryConflist(bridge, subnet, ipamDir, "")
}

// primaryConflist is nodeConflist as the primary CNI's installer writes it
// at a boot: with boot non-empty it records that boot in a top-level key
// ("primaryBoot"; runtimes ignore unknown top-level keys), so a test can
// tell which write a copy was made from.
func primaryConflist(bridge, subnet, ipamDir, boot string) ([]byte, error) {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       "ambientd-node",
		"plugins": []any{
			map[string]any{
				"type":      "bridge",
				"bridge":    bridge,
				"isGateway": true,
				"ipMasq":    false,
				"ipam": map[string]any{
					"type":    "host-local",
					"dataDir": ipamDir,
					"ranges":  [][]map[string]string{{{"subnet": subnet}}},
					"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
				},
			},
		},
	}
	if boot != "" {
		conf["primaryBoot"] = boot
	}
	return json.MarshalIndent(conf, "", "  ")
}

// shimPids lists the containerd-shim processes serving the containerd at
// address (their command line names it): containerd does not stop its shims
// when it exits, on purpose, so the environment kills them by pid.
func shimPids(address string) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || !strings.Contains(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for i, a := range args {
			if a == "-address" && i+1 < len(args) && args[i+1] == address {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

func killPids(pids []int) {
	for _, p := range pids {
		_ = syscall.Kill(p, syscall.SIGKILL)
	}
}

// ctrVersion asks containerd for its version through ctr (its readiness check).
func ctrVersion(ctx context.Context, ctr, address string) error {
	out, err := exec.CommandContext(ctx, ctr, "--address", address, "version").CombinedOutput()
	if err != nil {
		return fmt.Errorf("ctr version: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}
