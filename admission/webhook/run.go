package webhook

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/nodeagent/kube"
)

// Config is what `ambientd webhook` runs with (cmd/ambientd/webhook.go:
// one flag and one variable each, docs/readiness.md's settings table).
type Config struct {
	Listen, HealthAddr, MetricsAddr string
	// Namespace is the webhook's own (its CA Secret).
	Namespace string
	// AgentNamespace holds the agent's ConfigMap ConfigMapName.
	AgentNamespace, ConfigMapName string
	// Never are namespaces never mutated besides Namespace and
	// AgentNamespace.
	Never []string
	// The certificate: kept by the webhook (ManageCertificates) or read
	// from CertFile/KeyFile (cert-manager).
	ManageCertificates             bool
	SecretName                     string
	ConfigurationName, WebhookName string
	DNSNames                       []string
	CAValidity, CertValidity       time.Duration
	CertFile, KeyFile              string
	ReviewTimeout                  time.Duration
}

// Run serves the webhook until ctx ends.
func Run(ctx context.Context, cfg Config, client *kube.Client, log *slog.Logger) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	metrics := NewMetrics()
	cm := kube.ConfigMapInformer(client, cfg.AgentNamespace, cfg.ConfigMapName)
	nsFactory := kube.NewInformerFactory(client, nil)
	namespaces := nsFactory.Namespaces()
	inputs := ClusterInputs{ConfigMap: cm, Namespaces: namespaces, GetNamespace: getNamespace(client.CoreV1().Namespaces())}

	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { cm.Run(ctx.Done()) })
	nsFactory.Start(ctx.Done())
	defer nsFactory.Shutdown()

	var getCert func(*tls.ClientHelloInfo) (*tls.Certificate, error)
	var certReady func() bool
	if cfg.ManageCertificates {
		k := &CertKeeper{
			Secrets: client.Secrets(cfg.Namespace), Configs: client.MutatingWebhookConfigurations(),
			SecretName: cfg.SecretName, ConfigName: cfg.ConfigurationName, WebhookName: cfg.WebhookName,
			DNSNames: cfg.DNSNames, CAValidity: cfg.CAValidity, LeafValidity: cfg.CertValidity,
			Log: log, Metrics: metrics,
		}
		wg.Go(func() { k.Run(ctx) })
		getCert, certReady = k.GetCertificate, k.Ready
	} else {
		f := &FileCert{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile}
		getCert, certReady = f.GetCertificate, f.Ready
	}
	synced := func() bool { return cm.HasSynced() && namespaces.HasSynced() }

	h := &Handler{Inputs: inputs, Never: append([]string{cfg.Namespace, cfg.AgentNamespace}, cfg.Never...),
		Timeout: cfg.ReviewTimeout, Log: log, Metrics: metrics}
	// Reviews wait for the caches: a namespace missing from an unsynced
	// cache is read from the API anyway, but the ConfigMap would read as
	// absent (no gate).
	if !cache.WaitForCacheSync(ctx.Done(), cm.HasSynced, namespaces.HasSynced) {
		return ctx.Err()
	}
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", cfg.Listen, err)
	}
	errs := make(chan error, 3)
	wg.Go(func() { errs <- Serve(ctx, l, h, getCert) })
	health := http.NewServeMux()
	health.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	health.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case !synced():
			http.Error(w, "caches not synced", http.StatusServiceUnavailable)
		case !certReady():
			http.Error(w, "no serving certificate yet", http.StatusServiceUnavailable)
		default:
			_, _ = w.Write([]byte("ok\n"))
		}
	})
	mm := http.NewServeMux()
	mm.Handle("/metrics", promhttp.HandlerFor(metrics.Registry, promhttp.HandlerOpts{}))
	for _, s := range []struct {
		addr string
		h    http.Handler
	}{{cfg.HealthAddr, health}, {cfg.MetricsAddr, mm}} {
		if s.addr == "" {
			continue
		}
		srv := &http.Server{Addr: s.addr, Handler: s.h, ReadHeaderTimeout: 10 * time.Second}
		wg.Go(func() {
			if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
				errs <- fmt.Errorf("%s: %w", s.addr, err)
			}
		})
		wg.Go(func() { <-ctx.Done(); _ = srv.Close() })
	}
	log.Info("ambientd webhook serving", "listen", cfg.Listen, "path", Path, "manage_certificates", cfg.ManageCertificates)
	select {
	case <-ctx.Done():
		return nil
	case err := <-errs:
		return err
	}
}
