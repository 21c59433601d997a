package webhook

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The CA Secret's keys. The Secret is the one source of truth every
// replica reads: the CA that signs (and its predecessor, still trusted until
// it expires, so that leaves it signed stay valid during a CA rotation).
const (
	KeyCACert     = "ca.crt"
	KeyCAKey      = "ca.key"
	KeyPrevCACert = "previous-ca.crt"
	KeyPrevCAKey  = "previous-ca.key"
)

// TrustDelay is how long a new CA must have been in the webhook
// configuration's caBundle (as this replica read it) before leaves it signs
// are served: the kube-apiservers see a changed configuration through their
// watch, within a second or so, and a leaf they cannot verify would skip
// the webhook (failurePolicy Ignore) for the pods created meanwhile.
const TrustDelay = 30 * time.Second

// SecretClient and ConfigClient are the API calls the certificate keeper
// makes (kube.Client's Secrets(ns) and MutatingWebhookConfigurations()).
type (
	SecretClient interface {
		Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Secret, error)
		Create(ctx context.Context, s *corev1.Secret, opts metav1.CreateOptions) (*corev1.Secret, error)
		Update(ctx context.Context, s *corev1.Secret, opts metav1.UpdateOptions) (*corev1.Secret, error)
	}
	ConfigClient interface {
		Get(ctx context.Context, name string, opts metav1.GetOptions) (*admissionregistrationv1.MutatingWebhookConfiguration, error)
		Update(ctx context.Context, c *admissionregistrationv1.MutatingWebhookConfiguration, opts metav1.UpdateOptions) (*admissionregistrationv1.MutatingWebhookConfiguration, error)
	}
)

// CertKeeper keeps the webhook's serving certificate: a CA in a Secret
// (created by whichever replica comes first; a rotation is an update that
// carries the resourceVersion it read, so two replicas never write two
// CAs), the configuration's caBundle equal to the CAs the Secret trusts
// (only the webhook entry named WebhookName of the configuration named
// ConfigName is ever written), and a leaf certificate per replica, signed
// in memory and replaced at two thirds of its life. The TLS server takes
// the leaf through GetCertificate at every handshake, so a rotation drops
// no connection and no request.
type CertKeeper struct {
	Secrets      SecretClient
	Configs      ConfigClient
	SecretName   string
	ConfigName   string
	WebhookName  string
	DNSNames     []string
	CAValidity   time.Duration
	LeafValidity time.Duration
	// Resync bounds the time between two passes (the configuration's
	// caBundle restored after someone cleared it, a CA another replica
	// wrote).
	Resync  time.Duration
	Log     *slog.Logger
	Metrics *Metrics
	Now     func() time.Time // time.Now when nil

	leaf         atomic.Pointer[leafCert]
	mu           sync.Mutex
	trustedSince map[[32]byte]time.Time // CA cert fingerprint → first seen in the caBundle
}

type leafCert struct {
	cert    tls.Certificate
	signer  [32]byte // the CA's fingerprint
	renewAt time.Time
}

// GetCertificate is the tls.Config hook: the current leaf.
func (k *CertKeeper) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	l := k.leaf.Load()
	if l == nil {
		return nil, errors.New("ambientd webhook: no serving certificate yet")
	}
	return &l.cert, nil
}

// Ready reports whether a serving certificate is in place.
func (k *CertKeeper) Ready() bool { return k.leaf.Load() != nil }

// Run keeps the certificate until ctx ends: a pass now, then whenever the
// leaf or the CA is due, at least every Resync, and after a failed pass
// with a back-off (1 s doubling to Resync).
func (k *CertKeeper) Run(ctx context.Context) {
	backoff := time.Second
	for {
		next, err := k.Reconcile(ctx)
		if err != nil {
			k.log().Warn("webhook certificate: pass failed", "error", err, "retry_in", backoff)
			next, backoff = backoff, min(2*backoff, k.resync())
		} else {
			backoff = time.Second
		}
		t := time.NewTimer(min(next, k.resync()))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// Reconcile is one pass; it returns when the next one is due.
func (k *CertKeeper) Reconcile(ctx context.Context) (time.Duration, error) {
	now := k.now()
	ca, err := k.ensureCA(ctx, now)
	if err != nil {
		return 0, err
	}
	live, err := k.ensureBundle(ctx, ca.bundle())
	if err != nil {
		return 0, err
	}
	signer, wait := k.pickSigner(ca, live, now)
	next := min(ca.cur.renewAt.Sub(now), k.resync())
	if wait > 0 {
		next = min(next, wait)
	}
	l := k.leaf.Load()
	if l == nil || l.signer != signer.fingerprint || !now.Before(l.renewAt) {
		nl, notAfter, err := issueLeaf(signer, k.DNSNames, k.LeafValidity, now)
		if err != nil {
			return 0, err
		}
		k.leaf.Store(nl)
		k.Metrics.rotated("leaf", notAfter)
		k.log().Info("webhook certificate: serving a new leaf", "not_after", notAfter, "renew_at", nl.renewAt)
		l = nl
	}
	k.Metrics.inUse("ca", signer.cert.NotAfter)
	return max(min(next, l.renewAt.Sub(now)), 100*time.Millisecond), nil
}

// ensureCA reads the Secret and creates or rotates the CA when it must,
// with optimistic concurrency: a create that finds the Secret, or an update
// that finds it changed, is a replica that got there first — its CA is
// read and used.
func (k *CertKeeper) ensureCA(ctx context.Context, now time.Time) (caSet, error) {
	for attempt := 0; ; attempt++ {
		if attempt == 3 {
			return caSet{}, fmt.Errorf("secret %s: still changing after %d attempts", k.SecretName, attempt)
		}
		s, err := k.Secrets.Get(ctx, k.SecretName, metav1.GetOptions{})
		missing := apierrors.IsNotFound(err)
		if err != nil && !missing {
			return caSet{}, fmt.Errorf("read secret %s: %w", k.SecretName, err)
		}
		var set caSet
		var have bool
		if !missing {
			set, have, err = parseCASecret(s.Data, now)
			if err != nil {
				// Never overwrite what we cannot read: it may be someone
				// else's Secret under this name.
				return caSet{}, fmt.Errorf("secret %s: %w", k.SecretName, err)
			}
		}
		if have && now.Before(set.cur.renewAt) {
			return set, nil
		}
		next, err := newCA(k.CAValidity, now)
		if err != nil {
			return caSet{}, err
		}
		data := map[string][]byte{KeyCACert: next.certPEM, KeyCAKey: mustKeyPEM(next.key)}
		if have && now.Before(set.cur.cert.NotAfter) {
			data[KeyPrevCACert], data[KeyPrevCAKey] = set.cur.certPEM, mustKeyPEM(set.cur.key)
		}
		if missing {
			_, err = k.Secrets.Create(ctx, &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{Name: k.SecretName},
				Type:       corev1.SecretTypeOpaque, Data: data,
			}, metav1.CreateOptions{})
		} else {
			s = s.DeepCopy()
			s.Data = data // carries s.ResourceVersion: a concurrent write conflicts
			_, err = k.Secrets.Update(ctx, s, metav1.UpdateOptions{})
		}
		switch {
		case apierrors.IsAlreadyExists(err) || apierrors.IsConflict(err):
			continue // another replica wrote first: use its CA
		case err != nil:
			return caSet{}, fmt.Errorf("write secret %s: %w", k.SecretName, err)
		}
		k.Metrics.rotated("ca", next.cert.NotAfter)
		k.log().Info("webhook certificate: wrote a new CA", "secret", k.SecretName, "not_after", next.cert.NotAfter, "renew_at", next.renewAt)
	}
}

// ensureBundle makes the configuration's entry WebhookName carry bundle as
// its caBundle and returns the caBundle the entry had before (what the
// apiservers trust now). Only that entry of that configuration is written.
func (k *CertKeeper) ensureBundle(ctx context.Context, bundle []byte) ([]byte, error) {
	for attempt := 0; ; attempt++ {
		if attempt == 3 {
			return nil, fmt.Errorf("webhook configuration %s: still changing after %d attempts", k.ConfigName, attempt)
		}
		c, err := k.Configs.Get(ctx, k.ConfigName, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("read webhook configuration %s: %w", k.ConfigName, err)
		}
		i := entry(c, k.WebhookName)
		if i < 0 {
			return nil, fmt.Errorf("webhook configuration %s has no webhook named %s", k.ConfigName, k.WebhookName)
		}
		live := c.Webhooks[i].ClientConfig.CABundle
		if bytes.Equal(live, bundle) {
			return live, nil
		}
		c = c.DeepCopy()
		c.Webhooks[i].ClientConfig.CABundle = bundle
		_, err = k.Configs.Update(ctx, c, metav1.UpdateOptions{})
		switch {
		case apierrors.IsConflict(err):
			continue
		case err != nil:
			return nil, fmt.Errorf("update caBundle of %s/%s: %w", k.ConfigName, k.WebhookName, err)
		}
		k.log().Info("webhook certificate: caBundle updated", "webhook_configuration", k.ConfigName, "webhook", k.WebhookName)
		return live, nil
	}
}

func entry(c *admissionregistrationv1.MutatingWebhookConfiguration, name string) int {
	for i, w := range c.Webhooks {
		if w.Name == name {
			return i
		}
	}
	return -1
}

// pickSigner chooses the CA that signs this replica's leaf: the current
// one once it has been in the live caBundle for TrustDelay, else the
// previous one while the apiservers learn the new one. wait > 0 says when
// to look again.
func (k *CertKeeper) pickSigner(set caSet, live []byte, now time.Time) (caPair, time.Duration) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.trustedSince == nil {
		k.trustedSince = map[[32]byte]time.Time{}
	}
	if !bytes.Contains(live, set.cur.certPEM) {
		// Written just now (ensureBundle): the clock starts.
		delete(k.trustedSince, set.cur.fingerprint)
		if set.prev == nil {
			return set.cur, TrustDelay // nothing else to sign with (first start)
		}
		k.trustedSince[set.cur.fingerprint] = now
		return *set.prev, TrustDelay
	}
	since, seen := k.trustedSince[set.cur.fingerprint]
	if !seen {
		// Already trusted when this replica first looked (a restart, or
		// another replica rotated): the apiservers had their time.
		if set.prev == nil || k.leaf.Load() == nil {
			k.trustedSince[set.cur.fingerprint] = now.Add(-TrustDelay)
			return set.cur, 0
		}
		k.trustedSince[set.cur.fingerprint], since = now, now
	}
	if set.prev != nil && now.Sub(since) < TrustDelay {
		return *set.prev, TrustDelay - now.Sub(since)
	}
	return set.cur, 0
}

func (k *CertKeeper) now() time.Time {
	if k.Now != nil {
		return k.Now()
	}
	return time.Now()
}

func (k *CertKeeper) resync() time.Duration {
	if k.Resync > 0 {
		return k.Resync
	}
	return time.Minute
}

func (k *CertKeeper) log() *slog.Logger {
	if k.Log != nil {
		return k.Log
	}
	return slog.Default()
}
