package testutil

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// RunTestBinaryAs runs a copy of the test binary as uid:gid with the given
// ambient capabilities and environment (the caller's TestMain acts on env),
// and returns its combined output. The copy sits in a world-readable
// directory, since t.TempDir's parent is 0700. Needs root.
func RunTestBinaryAs(t testing.TB, uid, gid uint32, caps []uintptr, env []string) string {
	t.Helper()
	RequireRoot(t)
	dir, err := os.MkdirTemp("", "testutil-runas-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "helper")
	copyExecutable(t, os.Args[0], bin)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}, AmbientCaps: caps}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("test binary as uid %d: %v\n%s", uid, err, out)
	}
	return string(out)
}

func copyExecutable(t testing.TB, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}
