package main

import (
	"io"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestWebhookFlags: every setting comes from its flag or its variable (the
// flag wins), the certificate's DNS names follow the Service and namespace,
// and a value the webhook cannot serve with is refused with the flag's name.
func TestWebhookFlags(t *testing.T) {
	env := map[string]string{"AMBIENTD_WEBHOOK_NAMESPACE": "mesh", "AMBIENTD_WEBHOOK_CERT_VALIDITY": "30s", "AMBIENTD_WEBHOOK_SERVICE_NAME": "gate"}
	f, err := parseWebhookFlags([]string{"--service-name=gate-svc"}, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if f.cfg.Namespace != "mesh" || f.cfg.CertValidity != 30*time.Second || f.cfg.DNSNames[0] != "gate-svc.mesh.svc" {
		t.Errorf("config %+v", f.cfg)
	}
	if !slices.Contains(f.cfg.Never, "kube-system") || !f.cfg.ManageCertificates {
		t.Errorf("defaults: never %q, manage %v", f.cfg.Never, f.cfg.ManageCertificates)
	}
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{[]string{"--cert-validity=1s"}, "--cert-validity"},
		{[]string{"--ca-validity=2h", "--cert-validity=1h"}, "--cert-validity"},
		{[]string{"--ca-validity=1m"}, "--ca-validity"},
		{[]string{"--ca-validity=100000h"}, "--ca-validity"},
		{[]string{"--review-timeout=1m"}, "--review-timeout"},
		{[]string{"--namespace=Bad_NS"}, "--namespace"},
		{[]string{"--webhook-name=not a name"}, "--webhook-name"},
		{[]string{"--listen=9443"}, "--listen"},
		{[]string{"--log-level=loud"}, "--log-level"},
		{[]string{"--manage-certificates=false", "--tls-cert-file="}, "--tls-cert-file"},
		{[]string{"extra"}, "unexpected argument"},
	} {
		if _, err := parseWebhookFlags(tc.args, func(string) string { return "" }, io.Discard); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%v: error %v, want one naming %s", tc.args, err, tc.wantErr)
		}
	}
}
