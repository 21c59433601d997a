package e2eenv

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"

	"github.com/ambientd/ambientd/test/infra/build"
)

// Binaries are the programs the environment runs (test/infra/build finds
// and builds them).
type Binaries = build.Binaries

// RepoRoot finds the repository root.
func RepoRoot() (string, error) { return build.RepoRoot() }

// requireBinary reports a clear error when one of bin/ is missing.
func requireBinary(path string) error {
	if st, err := os.Stat(path); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("%s is not built (run `make build`)", path)
	}
	return nil
}

// exitDetail adds a failed command's stderr to its error.
func exitDetail(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(ee.Stderr))
	}
	return err
}
