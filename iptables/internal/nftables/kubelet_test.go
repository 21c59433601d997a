package nftables

import (
	"os"
	"path/filepath"
	"testing"
)

// TestFindKubeletUID: the uid of kubelet (with "kubelet" in its command
// line), kubelite or k3s, from a /proc-like tree; 0 and an error when none.
func TestFindKubeletUID(t *testing.T) {
	proc := func(t *testing.T, procs map[string][3]string) string {
		dir := t.TempDir()
		for pid, p := range procs {
			d := filepath.Join(dir, pid)
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, content := range map[string]string{"comm": p[0] + "\n", "cmdline": p[1], "status": "Name:\t" + p[0] + "\nUid:\t" + p[2] + "\t" + p[2] + "\t" + p[2] + "\t" + p[2] + "\n"} {
				if err := os.WriteFile(filepath.Join(d, name), []byte(content), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
		return dir
	}
	tests := []struct {
		name  string
		procs map[string][3]string
		want  uint32
		err   bool
	}{
		{"kubelet", map[string][3]string{"1": {"systemd", "/sbin/init", "0"}, "42": {"kubelet", "/usr/bin/kubelet\x00--config", "1001"}}, 1001, false},
		{"kubelet comm without kubelet in cmdline", map[string][3]string{"42": {"kubelet", "/opt/other", "7"}}, 0, true},
		{"k3s", map[string][3]string{"9": {"k3s", "/usr/local/bin/k3s\x00agent", "0"}}, 0, false},
		{"kubelite", map[string][3]string{"9": {"kubelite", "/snap/microk8s/kubelite\x00--kubelet-args-file", "5"}}, 5, false},
		{"none", map[string][3]string{"1": {"systemd", "/sbin/init", "0"}}, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := findKubeletUID(proc(t, tt.procs))
			if got != tt.want || (err != nil) != tt.err {
				t.Fatalf("findKubeletUID = %d, %v; want %d, error %v", got, err, tt.want, tt.err)
			}
		})
	}
	if _, err := findKubeletUID("/nonexistent-proc"); err == nil {
		t.Fatal("no error for a missing proc dir")
	}
}
