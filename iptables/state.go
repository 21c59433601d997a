package iptables

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The backend choice is sticky: once made on a node it is kept across
// restarts (persisted in StateDir, keyed by the node's network namespace),
// so the rules are never split over two backends. Migration follows Istio's
// rule: stay on the current backend until the node is clean (no host rules
// or probe sets of ours in it — after a reboot, or DeleteHostRules with all
// pods removed).

// stateFile is the file in StateDir holding the chosen backend.
const stateFile = "rules-backend"

// netnsID identifies the calling thread's network namespace (its inode), so
// a state file written for another namespace (another node sharing the
// directory, as tests do) is not followed.
func netnsID() (string, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/net", &st); err != nil {
		return "", fmt.Errorf("reading network namespace: %w", err)
	}
	return strconv.FormatUint(st.Ino, 10), nil
}

// readState returns the persisted backend for this namespace, or "".
func (m *Manager) readState() (Mode, error) {
	if m.cfg.StateDir == "" {
		return "", nil
	}
	path := filepath.Join(m.cfg.StateDir, stateFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	id, err := netnsID()
	if err != nil {
		return "", err
	}
	fields := strings.Fields(string(b))
	if len(fields) != 2 || fields[1] != "netns="+id {
		m.log.Info("rule backend state is for another network namespace; ignored", "path", path, "content", strings.TrimSpace(string(b)))
		return "", nil
	}
	mode, err := ParseMode(fields[0])
	if err != nil || mode == ModeAuto {
		m.log.Warn("rule backend state unreadable; ignored", "path", path, "content", strings.TrimSpace(string(b)))
		return "", nil
	}
	return mode, nil
}

// persist records the chosen backend (atomically: write then rename).
func (m *Manager) persist() error {
	if m.cfg.StateDir == "" {
		return nil
	}
	id, err := netnsID()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(m.cfg.StateDir, 0o755); err != nil {
		return fmt.Errorf("rule backend state dir: %w", err)
	}
	path := filepath.Join(m.cfg.StateDir, stateFile)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(string(m.mode)+" netns="+id+"\n"), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// ForgetChoice removes the persisted backend choice, once nothing of ours
// is left on the node — our host rules and probe sets deleted and every
// pod's rules handed over to another agent — so an install after that
// chooses afresh instead of moving the pods back to a backend none of them
// uses. A choice recorded for another network namespace stays. Nothing
// persisted is fine.
func (m *Manager) ForgetChoice() error {
	if m.cfg.StateDir == "" {
		return nil
	}
	mode, err := m.readState()
	if err != nil || mode == "" {
		return err
	}
	path := filepath.Join(m.cfg.StateDir, stateFile)
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("forgetting the rule backend: %w", err)
	}
	m.log.Info("rule backend choice forgotten: nothing of ours is left on the node", "mode", string(mode), "path", path)
	return nil
}
