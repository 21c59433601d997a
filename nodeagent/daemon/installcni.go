package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/istiometrics"
	"github.com/ambientd/ambientd/nodeagent/shutdownrule"
)

// InstallCNI is install-cni as `ambientd run --install-cni` runs it: the
// installer as a supervised Component, its Check for readiness, the
// shutdown rule that tells an uninstall from an upgrade, applied once by
// whichever of HandOver and Finish asks first, and the handover of the
// pods' rules to a successor's backend at an uninstall (--handover).
type InstallCNI struct {
	inst            *cniinstall.Installer
	shutdown        *shutdownrule.Rule
	rules           *iptables.Manager
	log             *slog.Logger
	shutdownTimeout time.Duration
	// successor takes the node over at an uninstall (--handover).
	successor iptables.Successor

	// The shutdown rule is applied once, by the first of HandOver and
	// Finish to ask.
	decideOnce sync.Once
	uninstall  bool
	reason     string
	decideErr  error
	// handedOver: the pods' rules went to the successor.
	handedOver bool
}

// NewInstallCNI wraps inst and the shutdown rule; nothing runs yet. Its
// Check belongs in the agent's readiness (and node condition), HandOver is
// the agent's Config.HandOver, and Finish, called once the daemon (the
// installer included) has stopped, applies the uninstall-on-shutdown rule.
func NewInstallCNI(inst *cniinstall.Installer, shutdown *shutdownrule.Rule, rules *iptables.Manager, successor iptables.Successor, log *slog.Logger) *InstallCNI {
	return &InstallCNI{inst: inst, shutdown: shutdown, rules: rules, log: log, shutdownTimeout: 10 * time.Second, successor: successor}
}

// decide applies the shutdown rule, once: the handover and the uninstall
// act on the same answer.
func (c *InstallCNI) decide(ctx context.Context) (uninstall bool, reason string, err error) {
	c.decideOnce.Do(func() {
		c.uninstall, c.reason, c.decideErr = c.shutdown.Decide(ctx)
		if c.decideErr == nil && c.uninstall {
			// From here on an agent that dies (SIGKILL, OOM, the node
			// going down) leaves an uninstall the plugin finishes.
			if err := c.inst.MarkUninstalling(); err != nil {
				c.log.Warn("cannot mark the install lease uninstalling; if this agent dies before the uninstall ends, the plugin finishes it only once the lease's TTL has passed", "error", err)
			}
		}
	})
	return c.uninstall, c.reason, c.decideErr
}

// HandOver is the agent's Config.HandOver: at an uninstall with a successor
// (--handover), it removes our host rules and probe sets — the successor's
// agent chooses its backend from the node as it finds it then — and returns
// a rule manager for the backend that agent will use, into which the agent
// moves every enrolled pod's rules. Otherwise (no successor, an upgrade or
// restart, no answer from the API) nil: the pods keep their rules.
func (c *InstallCNI) HandOver(ctx context.Context) (agent.SuccessorRules, error) {
	if c.successor == iptables.SuccessorNone {
		return nil, nil
	}
	uninstall, reason, err := c.decide(ctx)
	if err != nil || !uninstall {
		return nil, nil // Finish logs the decision
	}
	log := c.log.With("successor", string(c.successor))
	log.Info("uninstalling with a handover: moving every enrolled pod's rules to the successor's backend", "reason", reason)
	if err := c.rules.DeleteHostRules(ctx); err != nil {
		return nil, fmt.Errorf("removing our host rules before the handover: %w", err)
	}
	mode, err := iptables.SuccessorMode(ctx, c.successor, c.rules.Config().IPv6, log)
	if err != nil {
		return nil, err
	}
	cfg := c.rules.Config()
	cfg.Mode, cfg.StateDir = mode, "" // the successor's choice is not ours to persist
	to, err := iptables.NewManager(ctx, cfg, log.With("component", "iptables-successor"))
	if err != nil {
		return nil, fmt.Errorf("the successor's backend %s: %w", mode, err)
	}
	log.Info("handing the pods over", "backend", string(mode), "from", string(c.rules.Mode()))
	c.handedOver = true
	return to, nil
}

// UninstallingAlone is the agent's Config.Uninstalling: whether this stop
// is an uninstall with no successor (--handover none), so the pods whose
// condition is False are released. Asked only when HandOver gave no
// successor; an upgrade, a restart or a shutdown rule that cannot decide
// releases nothing.
func (c *InstallCNI) UninstallingAlone(ctx context.Context) bool {
	if c.successor != iptables.SuccessorNone {
		return false // HandOver decided, and failed: the pods keep their rules
	}
	uninstall, _, err := c.decide(ctx)
	return err == nil && uninstall
}

// Component is the installer as a daemon component: started first, stopped
// last; it retries failures itself and never stops early.
func (c *InstallCNI) Component() Component {
	return Func("CNI installer", func(ctx context.Context) error {
		// The shutdown rule needs one read of the DaemonSet with the
		// agent's identity first; it returns once it has it.
		go c.shutdown.Watch(ctx, c.log)
		go c.inst.RenewLease(ctx)
		return c.inst.Run(ctx)
	})
}

// CountInstalls counts the installer's rounds under Istio's
// istio_cni_installs_total (m nil: not counted); call it before the
// daemon runs.
func (c *InstallCNI) CountInstalls(m *istiometrics.Metrics) {
	if m == nil {
		return
	}
	c.inst.Observe(func(r cniinstall.Result) {
		switch r {
		case cniinstall.Installed:
			m.Install(istiometrics.InstallSuccess)
		case cniinstall.BinaryFailed:
			m.Install(istiometrics.InstallCopyBinariesFailure)
		case cniinstall.ConfigFailed:
			m.Install(istiometrics.InstallCreateCNIConfigFailure)
		case cniinstall.KubeconfigFailed:
			m.Install(istiometrics.InstallCreateKubeconfigFailure)
		}
	})
}

// Check is Ready as an error (nil = installed), the shape of
// nodeready.Inputs.PluginInstalled.
func (c *InstallCNI) Check() error { return c.inst.Check() }

// LeaseErr is the last install lease write's error, the shape of
// nodeready.Inputs.InstallLease.
func (c *InstallCNI) LeaseErr() error { return c.inst.LeaseErr() }

// Finish, once the installer has stopped (which leaves everything
// installed), uninstalls only when the DaemonSet is gone, being deleted or
// no longer selects this node, or the agent's identity was deleted
// (shutdownrule.Rule); otherwise (upgrade, restart) everything stays.
func (c *InstallCNI) Finish() error {
	ctx, cancel := context.WithTimeout(context.Background(), c.shutdownTimeout)
	defer cancel()
	uninstall, reason, err := c.decide(ctx)
	if err != nil {
		c.log.Warn("cannot tell uninstall from upgrade; leaving the plugin and rules in place", "error", err)
		return nil
	}
	if !uninstall {
		c.log.Info("leaving the CNI plugin, its config and the rules in place", "reason", reason)
		return nil
	}
	c.log.Info("uninstalling from the node", "reason", reason)
	err = UninstallNode(ctx, c.inst, c.rules)
	if err == nil && c.handedOver {
		// Nothing of ours is left: no host rules, no pod rules.
		err = c.rules.ForgetChoice()
	}
	if err != nil {
		c.log.Error("uninstall failed", "error", err)
	}
	return err
}

// UninstallNode removes the plugin's config entry (or owned file), its
// binary, then the host probe rules and sets. In-pod rules stay: they go
// with their pods.
func UninstallNode(ctx context.Context, inst *cniinstall.Installer, rules *iptables.Manager) error {
	if err := inst.Uninstall(); err != nil {
		return fmt.Errorf("uninstalling the CNI plugin: %w", err)
	}
	if err := rules.DeleteHostRules(ctx); err != nil {
		return fmt.Errorf("removing host rules: %w", err)
	}
	return nil
}
