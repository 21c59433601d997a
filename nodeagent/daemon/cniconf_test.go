package daemon

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
)

func TestPluginInConfDir(t *testing.T) {
	const bridge = `{"type":"bridge","bridge":"b0"}`
	list := func(name string, types ...string) string {
		var ps []string
		for _, ty := range types {
			ps = append(ps, `{"type":"`+ty+`"}`)
		}
		return `{"cniVersion":"1.0.0","name":"` + name + `","plugins":[` + strings.Join(ps, ",") + `]}`
	}
	tests := []struct {
		name    string
		files   map[string]string
		wantErr string // "" = installed
	}{
		{name: "ours last in the first conflist", files: map[string]string{"10-net.conflist": list("net", "bridge", "ambientd-cni")}},
		{name: "ours only in a later file", files: map[string]string{
			"10-net.conflist": list("net", "bridge"), "20-net.conflist": list("net", "bridge", "ambientd-cni")}, wantErr: "10-net.conflist"},
		{name: "invalid first file skipped", files: map[string]string{
			"05-broken.conflist": "{not json", "10-net.conflist": list("net", "bridge", "ambientd-cni")}},
		{name: "single .conf in use", files: map[string]string{"00-a.conf": bridge, "10-net.conflist": list("net", "ambientd-cni")}, wantErr: "00-a.conf"},
		{name: "other extensions ignored", files: map[string]string{"00-a.conflist.bak": list("x", "bridge"), "10-net.conflist": list("net", "ambientd-cni")}},
		{name: "empty dir", files: map[string]string{}, wantErr: "no valid CNI config"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			for n, c := range tt.files {
				if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			err := PluginInConfDir(dir, "ambientd-cni")
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("err = %v, want installed", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("err = %v, want one naming %q", err, tt.wantErr)
			}
		})
	}
	if err := PluginInConfDir(filepath.Join(t.TempDir(), "missing"), "ambientd-cni"); err == nil {
		t.Error("missing dir: no error")
	}
}

// TestPluginCheckNamesExclusiveCNI: without --install-cni too, a plugin
// config renamed away by Cilium's cni-exclusive since the agent started
// makes the check say so (the node condition's ExclusiveCNI); a backup
// from before the start does not.
func TestPluginCheckNamesExclusiveCNI(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("10-old.conflist.cilium_bak", `{"cniVersion":"1.0.0","name":"old","plugins":[{"type":"bridge"}]}`)
	write("10-net.conflist", `{"cniVersion":"1.0.0","name":"net","plugins":[{"type":"bridge"},{"type":"ambientd-cni"}]}`)
	// The kernel stamps ctime from its coarse clock, up to a tick behind
	// time.Now: the start is read from that clock (just after the old
	// backup's stamp), and the rename below waits for a later tick.
	started := kernelNow(t, dir).Add(time.Nanosecond)
	check := pluginCheck(dir, "ambientd-cni", started)
	if err := check(); err != nil {
		t.Fatalf("installed: %v", err)
	}
	write("05-cilium.conflist", `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni"}]}`)
	if err := check(); err == nil || errors.Is(err, cniinstall.ErrExclusiveCNI) {
		t.Fatalf("Cilium's config sorts first, nothing renamed: %v; want a plain failure", err)
	}
	for !kernelNow(t, dir).After(started) {
		runtime.Gosched()
	}
	if err := os.Rename(filepath.Join(dir, "10-net.conflist"), filepath.Join(dir, "10-net.conflist.cilium_bak")); err != nil {
		t.Fatal(err)
	}
	err := check()
	if !errors.Is(err, cniinstall.ErrExclusiveCNI) || !strings.Contains(err.Error(), "10-net.conflist renamed") || strings.Contains(err.Error(), "10-old") {
		t.Fatalf("check = %v; want ErrExclusiveCNI naming 10-net.conflist only", err)
	}
}

// kernelNow is the time the kernel stamps on a file changed now (its ctime
// clock), read from a probe file in dir.
func kernelNow(t *testing.T, dir string) time.Time {
	t.Helper()
	p := filepath.Join(dir, ".clock-probe")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(p, &st); err != nil {
		t.Fatal(err)
	}
	return time.Unix(st.Ctim.Sec, st.Ctim.Nsec)
}
