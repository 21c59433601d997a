package cniinstall

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/ambientd/ambientd/cniapi"
)

// The install lease (cniapi.InstallLease) tells the plugin, when no agent
// answers, whether one is coming back. The agent writes it first thing at
// start (WriteLease, before anything else can fail: an agent crash-looping
// still renews it), renews it while it runs (RenewLease), marks it
// uninstalling once it decided to uninstall (MarkUninstalling), and an
// uninstall removes it last, with the binary. See docs/install.md.

// maxLeaseRenewal bounds the renewal period: with the default TTL a lease
// is renewed ten times per TTL.
const maxLeaseRenewal = time.Minute

// LeasePath is the install lease's path: beside the plugin binary.
func LeasePath(binDir, pluginType string) string {
	return filepath.Join(binDir, pluginType+cniapi.LeaseSuffix)
}

func (i *Installer) leasePath() string { return LeasePath(i.cfg.BinDir, i.cfg.Entry.Type) }

// lease is the lease as this installer writes it in state.
func (i *Installer) lease(state string) cniapi.InstallLease {
	return cniapi.InstallLease{
		Version: cniapi.LeaseVersion, State: state, Renewed: time.Now().UTC(), TTL: i.cfg.LeaseTTL.String(),
		ConfDir: i.cfg.HostConfDir, ConfName: i.cfg.ConfName, OwnedName: i.cfg.OwnedName, InPlace: i.cfg.InPlace,
		PID: os.Getpid(), DaemonSetNamespace: i.cfg.DaemonSetNamespace, DaemonSetName: i.cfg.DaemonSetName,
		Policy: i.cfg.Policy,
	}
}

// KubeconfigPath is the plugin's kubeconfig's path: beside the plugin
// binary.
func KubeconfigPath(binDir, pluginType string) string {
	return filepath.Join(binDir, pluginType+cniapi.KubeconfigSuffix)
}

func (i *Installer) kubeconfigPath() string { return KubeconfigPath(i.cfg.BinDir, i.cfg.Entry.Type) }

// writeKubeconfig writes the plugin's kubeconfig (root only) when
// Credentials gives one that differs from the file's.
func (i *Installer) writeKubeconfig() error {
	if i.cfg.Credentials == nil {
		return nil
	}
	want, err := i.cfg.Credentials()
	if err != nil {
		return fmt.Errorf("plugin kubeconfig: %w", err)
	}
	if have, err := os.ReadFile(i.kubeconfigPath()); err == nil && bytes.Equal(have, want) {
		if fi, err := os.Stat(i.kubeconfigPath()); err == nil && fi.Mode().Perm() == 0o600 {
			return nil
		}
	}
	attrs := newFileAttrs()
	attrs.mode = 0o600
	if err := writeAtomic(i.kubeconfigPath(), want, attrs); err != nil {
		return fmt.Errorf("plugin kubeconfig: %w", err)
	}
	return nil
}

// WriteLease writes the lease, renewed now, in the installer's current state
// (installed until MarkUninstalling). It writes nothing once Uninstall ran.
func (i *Installer) WriteLease() error {
	i.lmu.Lock()
	defer i.lmu.Unlock()
	if i.leaseGone {
		return nil
	}
	state := cniapi.LeaseInstalled
	if i.uninstalling {
		state = cniapi.LeaseUninstalling
	}
	// The credentials first: a lease the plugin reads names what it may
	// ask the API. Without them the plugin fails every pod closed while
	// no agent answers (as before it could decide): logged, not a reason
	// to keep the node unready.
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		i.leaseErr = fmt.Errorf("install lease: creating CNI bin dir: %w", err)
		return i.leaseErr
	}
	kerr := i.writeKubeconfig()
	if kerr != nil {
		i.report(KubeconfigFailed)
	}
	i.leaseErr = i.writeLease(state)
	return errors.Join(i.leaseErr, kerr)
}

// LeaseErr is the last lease write's error (nil: written): while the
// lease or the plugin's kubeconfig cannot be written (a full disk, a
// read-only remount), the plugin cannot decide without the agent as this
// agent would, and readiness says so.
func (i *Installer) LeaseErr() error {
	i.lmu.Lock()
	defer i.lmu.Unlock()
	return i.leaseErr
}

func (i *Installer) writeLease(state string) error {
	data, err := json.MarshalIndent(i.lease(state), "", "  ")
	if err != nil {
		return fmt.Errorf("install lease: %w", err)
	}
	if err := os.MkdirAll(i.cfg.BinDir, 0o755); err != nil {
		return fmt.Errorf("install lease: creating CNI bin dir: %w", err)
	}
	attrs := newFileAttrs()
	attrs.mode = 0o644
	if err := writeAtomic(i.leasePath(), append(data, '\n'), attrs); err != nil {
		return fmt.Errorf("install lease: %w", err)
	}
	return nil
}

// MarkUninstalling records in the lease that the agent decided to
// uninstall: from now on a plugin that finds no agent finishes the
// uninstall itself instead of failing closed.
func (i *Installer) MarkUninstalling() error {
	i.lmu.Lock()
	defer i.lmu.Unlock()
	i.uninstalling = true
	if i.leaseGone {
		return nil
	}
	return i.writeLease(cniapi.LeaseUninstalling)
}

// LeaseRenewal is how often RenewLease rewrites the lease: a fifth of the
// TTL, at most a minute.
func (c Config) LeaseRenewal() time.Duration { return min(maxLeaseRenewal, c.LeaseTTL/5) }

// RenewLease rewrites the lease every LeaseRenewal until ctx ends; a failed
// write is logged and retried at the next period.
func (i *Installer) RenewLease(ctx context.Context) {
	t := time.NewTicker(i.cfg.LeaseRenewal())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := i.WriteLease(); err != nil {
				i.log.Warn("cannot renew the install lease or the plugin's kubeconfig; while no agent answers, the plugin may not be able to tell pods outside the mesh and lets none start", "path", i.leasePath(), "error", err)
			}
		}
	}
}

// removeLease removes the lease for good (under mu): the last step of an
// uninstall.
func (i *Installer) removeLease() error {
	i.lmu.Lock()
	defer i.lmu.Unlock()
	i.leaseGone = true
	if err := os.Remove(i.kubeconfigPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the plugin's kubeconfig: %w", err)
	}
	if err := os.Remove(i.leasePath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing install lease: %w", err)
	}
	return nil
}

// FromLease is the installer that finishes an uninstall from what the lease
// says (the plugin's recovery): the plugin binary pluginPath (in the CNI
// bin dir) and the conf dir and mode the lease names.
func FromLease(l cniapi.InstallLease, pluginPath string, log *slog.Logger) (*Installer, error) {
	ttl, err := time.ParseDuration(l.TTL)
	if err != nil {
		return nil, fmt.Errorf("install lease: ttl %q: %w", l.TTL, err)
	}
	return New(Config{
		BinSource: pluginPath, BinDir: filepath.Dir(pluginPath), ConfDir: l.ConfDir, HostConfDir: l.ConfDir,
		ConfName: l.ConfName, OwnedName: l.OwnedName, InPlace: l.InPlace, LeaseTTL: ttl,
		Entry: Entry{Type: filepath.Base(pluginPath)},
	}, log)
}

// FinishUninstall is Uninstall for a node the agent left: it removes our
// entries from the conf dir and, only if nothing of ours is left there, the
// binary and then the lease. A conf dir it cannot clean keeps the binary: a
// config naming a missing plugin fails every ADD for good.
func (i *Installer) FinishUninstall() error {
	i.mu.Lock()
	defer i.mu.Unlock()
	if fi, err := os.Stat(i.cfg.ConfDir); err != nil || !fi.IsDir() {
		return fmt.Errorf("CNI conf dir %s named by the install lease: not a directory (%v)", i.cfg.ConfDir, err)
	}
	// The plugin runs, so a config names it. If none in this conf dir
	// does, the runtime reads another one (a host conf dir set wrong, a
	// k3s-style layout): removing the binary would leave that config
	// failing every ADD for good.
	if names, err := i.namesPlugin(); err != nil {
		return err
	} else if !names {
		return fmt.Errorf("no config in the CNI conf dir %s named by the install lease names %s, yet a runtime ran it: the runtime reads another conf dir; the plugin binary stays (remove our entry there, then run `ambientd uninstall`)", i.cfg.ConfDir, i.cfg.Entry.Type)
	}
	if err := i.uninstallConfs(); err != nil {
		return err
	}
	if err := os.Remove(i.binPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing plugin binary: %w", err)
	}
	i.bin = binState{}
	return i.removeLease()
}
