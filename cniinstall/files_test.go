package cniinstall

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/test/infra/testutil"
)

// ownership is what a rewrite must keep besides the text.
type ownership struct {
	uid, gid uint32
	mode     os.FileMode
	xattrs   map[string]string
}

// primaryXattrs: a user attribute, a trusted one (root only) and an SELinux
// label, as a labelled host gives the primary's file.
var primaryXattrs = map[string]string{
	"user.origin":           "calico-install",
	"trusted.ambientd-test": "kept",
	"security.selinux":      "system_u:object_r:container_file_t:s0",
}

func setOwnership(t *testing.T, path string, o ownership) {
	t.Helper()
	if err := os.Chown(path, int(o.uid), int(o.gid)); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, o.mode); err != nil {
		t.Fatal(err)
	}
	for k, v := range o.xattrs {
		if err := unix.Setxattr(path, k, []byte(v), 0); err != nil {
			t.Fatalf("setxattr %s on %s: %v", k, path, err)
		}
	}
}

func ownershipOf(t *testing.T, path string) ownership {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	o := ownership{uid: st.Uid, gid: st.Gid, mode: os.FileMode(st.Mode & 0o777), xattrs: map[string]string{}}
	for k := range primaryXattrs {
		buf := make([]byte, 256)
		n, err := unix.Getxattr(path, k, buf)
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			t.Fatalf("getxattr %s on %s: %v", k, path, err)
		}
		o.xattrs[k] = string(buf[:n])
	}
	return o
}

func (o ownership) String() string {
	return fmt.Sprintf("uid=%d gid=%d mode=%v xattrs=%v", o.uid, o.gid, o.mode, o.xattrs)
}

func sameOwnership(a, b ownership) bool {
	if a.uid != b.uid || a.gid != b.gid || a.mode != b.mode || len(a.xattrs) != len(b.xattrs) {
		return false
	}
	for k, v := range a.xattrs {
		if b.xattrs[k] != v {
			return false
		}
	}
	return true
}

// Owner, group, mode and extended attributes (an SELinux label among them)
// of the primary's file survive our insert and our uninstall; a .conf
// converted to a conflist passes them on and gets them back; our owned file
// takes the primary's owner, group and label, mode 0600.
func TestOwnershipKept(t *testing.T) {
	testutil.RequireRoot(t)
	orig := ownership{uid: 1234, gid: 5678, mode: 0o640, xattrs: primaryXattrs}
	cases := []struct {
		name, file, content string
		owned               bool
		wantFile            string
		wantMode            os.FileMode
	}{
		{"in-place conflist", "10-calico.conflist", flannelConflist, false, "10-calico.conflist", 0o640},
		{"in-place conf converted", "10-mynet.conf", bridgeConf, false, "10-mynet.conflist", 0o640},
		{"owned", "10-calico.conflist", flannelConflist, true, DefaultOwnedName, 0o600},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostTree(t)
			p := h.path(tc.file)
			writeFile(t, p, tc.content, 0o644)
			setOwnership(t, p, orig)
			i := h.installer(t, func(c *Config) { c.InPlace = !tc.owned })
			if _, err := i.Install(); err != nil {
				t.Fatal(err)
			}
			if err := i.Check(); err != nil {
				t.Fatal(err)
			}
			want := orig
			want.mode = tc.wantMode
			if got := ownershipOf(t, h.path(tc.wantFile)); !sameOwnership(got, want) {
				t.Fatalf("%s after install: %v, want %v", tc.wantFile, got, want)
			}
			if tc.owned {
				if got := ownershipOf(t, p); !sameOwnership(got, orig) || readFile(t, p) != tc.content {
					t.Fatalf("owned mode changed the primary: %v", got)
				}
			}
			if err := i.Uninstall(); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, p); got != tc.content {
				t.Fatalf("after uninstall %s =\n%s\nwant\n%s", tc.file, got, tc.content)
			}
			if got := ownershipOf(t, p); !sameOwnership(got, orig) {
				t.Fatalf("%s after uninstall: %v, want %v", tc.file, got, orig)
			}
		})
	}
}

// A primary config that is a symlink stays one: in-place mode edits the
// file it points to (inside the conf dir); owned mode copies it. Uninstall
// gives the target back byte for byte.
func TestSymlinkedPrimary(t *testing.T) {
	for _, owned := range []bool{false, true} {
		name := "in-place"
		if owned {
			name = "owned"
		}
		t.Run(name, func(t *testing.T) {
			h := newHostTree(t)
			if err := os.MkdirAll(h.path("calico"), 0o755); err != nil {
				t.Fatal(err)
			}
			target := h.path("calico/10-calico.conflist")
			writeFile(t, target, flannelConflist, 0o644)
			link := h.path("10-calico.conflist")
			if err := os.Symlink("calico/10-calico.conflist", link); err != nil {
				t.Fatal(err)
			}
			i := h.installer(t, func(c *Config) { c.InPlace = !owned })
			if _, err := i.Install(); err != nil {
				t.Fatal(err)
			}
			if err := i.Check(); err != nil {
				t.Fatal(err)
			}
			assertLink := func(when string) {
				t.Helper()
				if dst, err := os.Readlink(link); err != nil || dst != "calico/10-calico.conflist" {
					t.Fatalf("%s: %s is no longer the symlink it was: %q %v", when, link, dst, err)
				}
			}
			assertLink("after install")
			name, chain := runtimeView(t, h.conf)
			if chain[len(chain)-1] != "ambientd-cni" {
				t.Fatalf("runtime uses %s %v", name, chain)
			}
			if owned != (readFile(t, target) == flannelConflist) {
				t.Fatalf("target after install (owned=%v):\n%s", owned, readFile(t, target))
			}
			if err := i.Uninstall(); err != nil {
				t.Fatal(err)
			}
			assertLink("after uninstall")
			if readFile(t, target) != flannelConflist {
				t.Fatalf("target after uninstall:\n%s", readFile(t, target))
			}
		})
	}
}

// A symlink the agent cannot follow as the host does — absolute (inside
// the agent's container it names another file), or leading out of the conf
// dir — is refused with the reason, in both modes, and readiness says the
// agent cannot tell which config the runtime uses; nothing is written. A
// symlinked .conf is not converted in in-place mode (that would replace the
// link by a file).
func TestSymlinkRefused(t *testing.T) {
	cases := []struct {
		name, link, target string
		inPlace            bool
		want               string
	}{
		{"absolute", "10-calico.conflist", "ABS", false, "absolute path"},
		{"absolute in-place", "10-calico.conflist", "ABS", true, "absolute path"},
		{"out of the dir", "10-calico.conflist", "../../outside.conflist", false, "leads out of"},
		{"symlinked conf in-place", "10-mynet.conf", "real/mynet.conf", true, "is a symlink"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostTree(t)
			outside := filepath.Join(h.root, "etc/cni/outside.conflist")
			writeFile(t, outside, flannelConflist, 0o644)
			if err := os.MkdirAll(h.path("real"), 0o755); err != nil {
				t.Fatal(err)
			}
			writeFile(t, h.path("real/mynet.conf"), bridgeConf, 0o644)
			target := tc.target
			if target == "ABS" {
				target = outside
			}
			if err := os.Symlink(target, h.path(tc.link)); err != nil {
				t.Fatal(err)
			}
			i := h.installer(t, func(c *Config) { c.InPlace = tc.inPlace })
			_, err := i.Install()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Install = %v, want an error containing %q", err, tc.want)
			}
			t.Logf("refused: %v", err)
			if i.Check() == nil {
				t.Fatal("Check says installed")
			}
			if readFile(t, outside) != flannelConflist || readFile(t, h.path("real/mynet.conf")) != bridgeConf || exists(h.path(DefaultOwnedName)) {
				t.Fatal("a refused symlink's target was written, or an owned copy made")
			}
			if fi, err := os.Lstat(h.path(tc.link)); err != nil || fi.Mode()&os.ModeSymlink == 0 {
				t.Fatalf("%s is no longer a symlink: %v", tc.link, err)
			}
		})
	}
}

// The owned file's name belongs to someone else (no mark): never replaced.
func TestOwnedNameTakenByAnother(t *testing.T) {
	h := newHostTree(t)
	writeFile(t, h.path("10-flannel.conflist"), flannelConflist, 0o644)
	theirs := `{"cniVersion":"1.0.0","name":"theirs","plugins":[{"type":"x"}]}`
	writeFile(t, h.path(DefaultOwnedName), theirs, 0o644)
	i := h.installer(t)
	if _, err := i.Install(); err == nil || !strings.Contains(err.Error(), "is not ours") {
		t.Fatalf("Install = %v, want a refusal", err)
	}
	if !bytes.Equal([]byte(readFile(t, h.path(DefaultOwnedName))), []byte(theirs)) {
		t.Fatal("another component's file was replaced")
	}
}
