package main

import (
	"flag"
	"fmt"

	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/nodeagent/repair"
)

// sidecarEnvOf maps sidecar mode's flags to their environment variables
// (parseFlags).
var sidecarEnvOf = flagEnv{
	"sidecar":                         "AMBIENTD_SIDECAR",
	"repair-mode":                     "AMBIENTD_REPAIR_MODE",
	"repair-label-key":                "AMBIENTD_REPAIR_LABEL_KEY",
	"repair-label-value":              "AMBIENTD_REPAIR_LABEL_VALUE",
	"repair-sidecar-annotation":       "AMBIENTD_REPAIR_SIDECAR_ANNOTATION",
	"repair-init-container-name":      "AMBIENTD_REPAIR_INIT_CONTAINER_NAME",
	"repair-init-exit-code":           "AMBIENTD_REPAIR_INIT_EXIT_CODE",
	"repair-init-termination-message": "AMBIENTD_REPAIR_INIT_TERMINATION_MESSAGE",
	"repair-label-selectors":          "AMBIENTD_REPAIR_LABEL_SELECTORS",
	"repair-field-selectors":          "AMBIENTD_REPAIR_FIELD_SELECTORS",
}

// sidecarFlags registers sidecar mode's settings (docs/sidecar.md) on fs
// (their variables: sidecarEnvOf) and returns the function to call after
// parseFlags: it returns the validated daemon.SidecarConfig.
func sidecarFlags(fs *flag.FlagSet) func() (daemon.SidecarConfig, error) {
	d := repair.DefaultConfig()
	var (
		enabled  bool
		mode     string
		exitCode int
		c        = d
	)
	fs.BoolVar(&enabled, "sidecar", true, "capture pods with an injected istio-proxy (Istio's istio-cni sidecar mode: rules to the pod's own proxy, never to ztunnel)")
	fs.StringVar(&mode, "repair-mode", string(d.Mode), "what the repair controller does with a sidecar pod whose istio-validation init container failed with --repair-init-exit-code: repair (program its rules), delete (needs the deploy/components/repair-delete component), label (needs deploy/components/repair-label) or off")
	fs.StringVar(&c.LabelKey, "repair-label-key", d.LabelKey, "label key the label mode sets")
	fs.StringVar(&c.LabelValue, "repair-label-value", d.LabelValue, "label value the label mode sets")
	fs.StringVar(&c.SidecarAnnotation, "repair-sidecar-annotation", d.SidecarAnnotation, "annotation a pod must carry to be repaired (empty: any pod)")
	fs.StringVar(&c.InitContainerName, "repair-init-container-name", d.InitContainerName, "init container whose failure marks a broken pod")
	fs.IntVar(&exitCode, "repair-init-exit-code", int(d.InitExitCode), "exit code of that container that marks a broken pod (0: any)")
	fs.StringVar(&c.InitTerminationMessage, "repair-init-termination-message", "", "termination message that container must have ended with (empty: any)")
	fs.StringVar(&c.LabelSelector, "repair-label-selectors", "", "label selector restricting the pods repaired")
	fs.StringVar(&c.FieldSelector, "repair-field-selectors", "", "field selector restricting the pods repaired (metadata.name, metadata.namespace, spec.serviceAccountName, status.phase)")
	return func() (daemon.SidecarConfig, error) {
		m, err := repair.ParseMode(mode)
		if err != nil {
			return daemon.SidecarConfig{}, fmt.Errorf("--repair-mode: %w", err)
		}
		if exitCode < 0 || exitCode > 255 {
			return daemon.SidecarConfig{}, fmt.Errorf("--repair-init-exit-code %d: want 0..255", exitCode)
		}
		if m == repair.ModeLabel && c.LabelKey == "" {
			return daemon.SidecarConfig{}, fmt.Errorf("--repair-label-key: required by --repair-mode label")
		}
		if !enabled && m == repair.ModeRepair {
			// Repairing programs sidecar rules: without sidecar mode
			// there is nothing to program them with.
			m = repair.ModeOff
		}
		c.Mode, c.InitExitCode = m, int32(exitCode)
		return daemon.SidecarConfig{Disabled: !enabled, Repair: c}, nil
	}
}
