package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/settings"
)

// settingsFlags are the agent settings `inject` and `check` decide with
// (the agent's own flags and variables, same names and defaults); given,
// they win over what `check` reads from the cluster.
type settingsFlags struct {
	excludeNamespaces, systemNamespace, conditionType string
	given                                             map[string]bool
}

// settingsVar names the variables of the agent settings inject and check
// read (the agent's: admission.EnvExcludeNamespaces, …).
func settingsVar(name string) string {
	switch name {
	case "exclude-namespaces", "system-namespace", "pod-condition-type":
		return settings.Var(name)
	}
	return ""
}

func (s *settingsFlags) register(fs *flag.FlagSet) {
	d := admission.DefaultSettings()
	fs.StringVar(&s.excludeNamespaces, "exclude-namespaces", strings.Join(d.Policy.ExcludeNamespaces, ","), "comma-separated namespaces the agent never enrolls (as `ambientd run`)")
	fs.StringVar(&s.systemNamespace, "system-namespace", d.Policy.SystemNamespace, "the mesh's own namespace (as `ambientd run`)")
	fs.StringVar(&s.conditionType, "pod-condition-type", d.ConditionType, "the pod condition the readiness gate names (as `ambientd run`)")
}

// parse notes which settings the command line or the variables gave, and
// validates; call after settings.Parse(..., settingsVar).
func (s *settingsFlags) parse(fs *flag.FlagSet) error {
	s.given = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { s.given[f.Name] = true }) // set by settings.Parse too
	for _, n := range s.settings(admission.DefaultSettings()).Policy.ExcludeNamespaces {
		if errs := validation.IsDNS1123Label(n); len(errs) > 0 {
			return fmt.Errorf("--exclude-namespaces: %q: %s", n, strings.Join(errs, "; "))
		}
	}
	if errs := validation.IsDNS1123Label(s.systemNamespace); len(errs) > 0 {
		return fmt.Errorf("--system-namespace %q: %s", s.systemNamespace, strings.Join(errs, "; "))
	}
	if errs := validation.IsQualifiedName(s.conditionType); len(errs) > 0 {
		return fmt.Errorf("--pod-condition-type %q: %s", s.conditionType, strings.Join(errs, "; "))
	}
	return nil
}

// settings returns base with the flags given on the command line (or by
// their variables) applied.
func (s *settingsFlags) settings(base admission.Settings) admission.Settings {
	data := map[string]string{}
	if s.given["exclude-namespaces"] {
		data[admission.EnvExcludeNamespaces] = s.excludeNamespaces
	}
	if s.given["system-namespace"] {
		data[admission.EnvSystemNamespace] = s.systemNamespace
	}
	if s.given["pod-condition-type"] {
		data[admission.EnvConditionType] = s.conditionType
	}
	over := admission.SettingsFrom(data)
	if _, ok := data[admission.EnvExcludeNamespaces]; ok {
		base.Policy.ExcludeNamespaces = over.Policy.ExcludeNamespaces
	}
	if _, ok := data[admission.EnvSystemNamespace]; ok {
		base.Policy.SystemNamespace = over.Policy.SystemNamespace
	}
	if _, ok := data[admission.EnvConditionType]; ok {
		base.ConditionType = over.ConditionType
	}
	return base
}

// clientFlags locate the cluster as kubectl does: --kubeconfig, else
// $KUBECONFIG, else ~/.kube/config; --context picks a context.
type clientFlags struct {
	kubeconfig, context string
}

func (c *clientFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, as kubectl)")
	fs.StringVar(&c.context, "context", "", "kubeconfig context (default: the current one)")
}

// client returns a client and the context's namespace ("default" if none).
func (c *clientFlags) client(_ context.Context) (*kube.Client, string, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	if c.kubeconfig != "" {
		rules.ExplicitPath = c.kubeconfig
	}
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: c.context})
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	cfg.UserAgent = "ambientd/" + version
	ns, _, err := cc.Namespace()
	if err != nil || ns == "" {
		ns = "default"
	}
	client, err := kube.NewForConfig(cfg)
	if err != nil {
		return nil, "", fmt.Errorf("kubernetes client: %w", err)
	}
	return client, ns, nil
}

// parseClientFlags parses the flags of a client command (inject, check)
// and the settings' variables; ok=false: exit with code.
func parseClientFlags(fs *flag.FlagSet, args []string, sf *settingsFlags, getenv func(string) string, stderr io.Writer) (code int, ok bool) {
	err := settings.Parse(fs, args, getenv, settingsVar)
	if err == nil {
		err = sf.parse(fs)
	}
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0, false
	case settings.IsUsageError(err):
		return 2, false // fs printed it, with the usage
	case err != nil:
		fmt.Fprintf(stderr, "%s: %v\n", fs.Name(), err)
		return 2, false
	}
	return 0, true
}

// openInput opens a manifest file, or returns stdin for "-".
func openInput(path string, stdin io.Reader) (io.ReadCloser, error) {
	if path == "-" {
		return io.NopCloser(stdin), nil
	}
	return os.Open(path)
}
