package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/webhook"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/settings"
)

// webhookVar names the webhook's variables: the agent's for the settings
// of the same meaning (the kubeconfig, the log level), its own
// (AMBIENTD_WEBHOOK_<FLAG>) for the rest.
func webhookVar(name string) string {
	switch name {
	case "kubeconfig", "log-level":
		return settings.Var(name)
	}
	return settings.CommandVar("webhook", name)
}

// webhookCmd serves the readiness-gate admission webhook (admission/webhook).
func webhookCmd(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return runWebhook(ctx, args, os.Getenv, os.Stderr)
}

type webhookFlags struct {
	cfg                  webhook.Config
	kubeconfig, logLevel string
	serviceName          string
}

func parseWebhookFlags(args []string, getenv func(string) string, stderr io.Writer) (webhookFlags, error) {
	var f webhookFlags
	c := &f.cfg
	fs := flag.NewFlagSet("ambientd webhook", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (empty: in-cluster)")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.Listen, "listen", ":9443", "address of the HTTPS admission endpoint ("+webhook.Path+")")
	fs.StringVar(&c.HealthAddr, "health-addr", ":8000", "address of /healthz and /readyz (empty: none)")
	fs.StringVar(&c.MetricsAddr, "metrics-addr", ":15014", "address of /metrics (empty: none)")
	fs.StringVar(&c.Namespace, "namespace", admission.DefaultAgentNamespace, "the webhook's own namespace (its CA Secret); never mutated")
	fs.StringVar(&c.AgentNamespace, "agent-namespace", admission.DefaultAgentNamespace, "the agent's namespace (its ConfigMap); never mutated")
	fs.StringVar(&c.ConfigMapName, "config-map", admission.ConfigMapName, "the agent's ConfigMap: the settings the gate decision reads, as the admission policy's param")
	fs.BoolVar(&c.ManageCertificates, "manage-certificates", true, "keep the serving certificate: a CA in --secret-name, the caBundle of --webhook-configuration; false: serve --tls-cert-file/--tls-key-file (cert-manager)")
	fs.StringVar(&c.SecretName, "secret-name", "ambientd-webhook-ca", "the Secret (in --namespace) holding the webhook's CA")
	fs.StringVar(&c.ConfigurationName, "webhook-configuration", admission.MutatingPolicyName, "the MutatingWebhookConfiguration whose caBundle is kept")
	fs.StringVar(&c.WebhookName, "webhook-name", admission.WebhookName, "the webhook entry of --webhook-configuration whose caBundle is kept (no other is written)")
	fs.StringVar(&f.serviceName, "service-name", "ambientd-webhook", "the Service in front of the webhook: the serving certificate's DNS names")
	fs.DurationVar(&c.CAValidity, "ca-validity", 365*24*time.Hour, "life of a CA the webhook creates (replaced at two thirds; 1h..87600h)")
	fs.DurationVar(&c.CertValidity, "cert-validity", 24*time.Hour, "life of a serving certificate (replaced at two thirds; 10s..--ca-validity/3)")
	fs.StringVar(&c.CertFile, "tls-cert-file", "/etc/ambientd-webhook/tls.crt", "with --manage-certificates=false: the serving certificate (re-read when it changes)")
	fs.StringVar(&c.KeyFile, "tls-key-file", "/etc/ambientd-webhook/tls.key", "with --manage-certificates=false: its key")
	fs.DurationVar(&c.ReviewTimeout, "review-timeout", 5*time.Second, "longest one review may take (a namespace lookup); then the pod is admitted without the gate (100ms..25s)")
	fs.Usage = func() {
		fmt.Fprintf(stderr, "usage: ambientd webhook [flags]\n\nServes the mutating admission webhook that adds the readiness gate to the pods the agent\nwill enroll (clusters without the MutatingAdmissionPolicy: Kubernetes before 1.36).\n\n")
		fs.PrintDefaults()
	}
	if err := settings.Parse(fs, args, getenv, webhookVar); err != nil {
		return f, err
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if _, err := parseLevel(f.logLevel); err != nil {
		return f, fmt.Errorf("--log-level: %w", err)
	}
	for name, v := range map[string]string{"namespace": c.Namespace, "agent-namespace": c.AgentNamespace, "service-name": f.serviceName} {
		if errs := validation.IsDNS1123Label(v); len(errs) > 0 {
			return f, fmt.Errorf("--%s %q: %s", name, v, strings.Join(errs, "; "))
		}
	}
	for name, v := range map[string]string{"config-map": c.ConfigMapName, "secret-name": c.SecretName, "webhook-configuration": c.ConfigurationName, "webhook-name": c.WebhookName} {
		if errs := validation.IsDNS1123Subdomain(v); len(errs) > 0 {
			return f, fmt.Errorf("--%s %q: %s", name, v, strings.Join(errs, "; "))
		}
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		return f, fmt.Errorf("--listen %q: %w", c.Listen, err)
	}
	switch {
	case c.CAValidity < time.Hour || c.CAValidity > 10*365*24*time.Hour:
		return f, fmt.Errorf("--ca-validity %v: from 1h to 87600h (10 years)", c.CAValidity)
	case c.CertValidity < 10*time.Second || c.CertValidity > c.CAValidity/3:
		return f, fmt.Errorf("--cert-validity %v: from 10s to a third of --ca-validity (%v)", c.CertValidity, c.CAValidity/3)
	case c.ReviewTimeout < 100*time.Millisecond || c.ReviewTimeout > 25*time.Second:
		return f, fmt.Errorf("--review-timeout %v: from 100ms to 25s (the apiserver waits 30s at most)", c.ReviewTimeout)
	case !c.ManageCertificates && (c.CertFile == "" || c.KeyFile == ""):
		return f, errors.New("--manage-certificates=false needs --tls-cert-file and --tls-key-file")
	}
	s, ns := f.serviceName, c.Namespace
	c.DNSNames = []string{s + "." + ns + ".svc", s, s + "." + ns, s + "." + ns + ".svc.cluster.local"}
	c.Never = []string{"kube-system"}
	return f, nil
}

func runWebhook(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	f, err := parseWebhookFlags(args, getenv, stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case settings.IsUsageError(err):
		return 2
	case err != nil:
		fmt.Fprintf(stderr, "ambientd webhook: %v\n", err)
		return 2
	}
	level, _ := parseLevel(f.logLevel)
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	rc, err := kubeConfig(f.kubeconfig)
	if err != nil {
		log.Error("ambientd webhook", "error", err)
		return 1
	}
	rc.UserAgent = "ambientd-webhook/" + version
	client, err := kube.NewForConfig(rc)
	if err != nil {
		log.Error("ambientd webhook", "error", err)
		return 1
	}
	if err := webhook.Run(ctx, f.cfg, client, log); err != nil {
		log.Error("ambientd webhook", "error", err)
		return 1
	}
	return 0
}
