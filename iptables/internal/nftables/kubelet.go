package nftables

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// findKubeletUID returns the uid of the kubelet-hosting process (kubelet,
// MicroK8s' kubelite, k3s) found in procDir, as Istio keys its nft probe
// SNAT; 0 when none is found.
func findKubeletUID(procDir string) (uint32, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", procDir, err)
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		dir := filepath.Join(procDir, e.Name())
		comm, err := os.ReadFile(filepath.Join(dir, "comm"))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(comm)) {
		case "kubelet", "kubelite":
			cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
			if err != nil || !strings.Contains(strings.ToLower(string(cmdline)), "kubelet") {
				continue
			}
		case "k3s":
		default:
			continue
		}
		status, err := os.ReadFile(filepath.Join(dir, "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(status), "\n") {
			if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
				if f := strings.Fields(rest); len(f) > 0 {
					if uid, err := strconv.ParseUint(f[0], 10, 32); err == nil {
						return uint32(uid), nil
					}
				}
			}
		}
	}
	return 0, fmt.Errorf("no kubelet process in %s", procDir)
}
