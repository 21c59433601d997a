package webhook

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

const testNS = "istio-system"

// clock is a settable now.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func newFakeCluster() *fake.Clientset {
	other := []byte("-----BEGIN CERTIFICATE-----\nnot ours\n-----END CERTIFICATE-----\n")
	return fake.NewClientset(&admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "ambientd-readiness-gate"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{
			{Name: "someone-else.example.com", ClientConfig: admissionregistrationv1.WebhookClientConfig{CABundle: other}},
			{Name: "readiness-gate.ambientd.io"},
		},
	}, &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "another-config"},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{{Name: "readiness-gate.ambientd.io"}},
	})
}

func keeper(c *fake.Clientset, clk *clock) *CertKeeper {
	return &CertKeeper{
		Secrets: c.CoreV1().Secrets(testNS), Configs: c.AdmissionregistrationV1().MutatingWebhookConfigurations(),
		SecretName: "ambientd-webhook-ca", ConfigName: "ambientd-readiness-gate", WebhookName: "readiness-gate.ambientd.io",
		DNSNames:   []string{"ambientd-webhook.istio-system.svc"},
		CAValidity: 90 * 24 * time.Hour, LeafValidity: 24 * time.Hour, Now: clk.now,
	}
}

// bundleOf returns the caBundle of a configuration's entry.
func bundleOf(t *testing.T, c *fake.Clientset, config, name string) []byte {
	t.Helper()
	cfg, err := c.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(context.Background(), config, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Webhooks[entry(cfg, name)].ClientConfig.CABundle
}

// verifies reports whether the keeper's current leaf verifies, at now,
// against caBundle for the service name — what the apiserver checks.
func verifies(t *testing.T, k *CertKeeper, caBundle []byte, now time.Time) error {
	t.Helper()
	cert, err := k.GetCertificate(&tls.ClientHelloInfo{})
	if err != nil {
		return err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caBundle) {
		t.Fatalf("caBundle has no certificate: %q", caBundle)
	}
	_, err = cert.Leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: k.DNSNames[0], CurrentTime: now})
	return err
}

// TestReplicasAgreeOnOneCA: two replicas starting together write one CA
// (the second one's create finds the first one's Secret and uses it), the
// configuration's entry carries it, and both replicas' leaves verify
// against it. Nothing else is written: not the other webhook of the same
// configuration, not a configuration of another name.
func TestReplicasAgreeOnOneCA(t *testing.T) {
	ctx := context.Background()
	c := newFakeCluster()
	clk := &clock{time.Now()}
	a, b := keeper(c, clk), keeper(c, clk)
	// b's create races another replica's: that one's Secret lands first
	// (written through the tracker, under the fake's reactor lock).
	raced := false
	c.PrependReactor("create", "secrets", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if raced {
			return false, nil, nil
		}
		raced = true
		ca, err := newCA(a.CAValidity, clk.t)
		if err != nil {
			t.Error(err)
		}
		first := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "ambientd-webhook-ca", Namespace: testNS},
			Data: map[string][]byte{KeyCACert: ca.certPEM, KeyCAKey: mustKeyPEM(ca.key)}}
		if err := c.Tracker().Create(corev1.SchemeGroupVersion.WithResource("secrets"), first, testNS); err != nil {
			t.Error(err)
		}
		return true, nil, apierrors.NewAlreadyExists(corev1.Resource("secrets"), "ambientd-webhook-ca")
	})
	if _, err := b.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if !raced {
		t.Fatal("the race was not run")
	}
	if _, err := a.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	s, err := c.CoreV1().Secrets(testNS).Get(ctx, "ambientd-webhook-ca", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bundle := bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")
	if !bytes.Equal(bundle, s.Data[KeyCACert]) {
		t.Fatalf("caBundle is not the Secret's CA")
	}
	for name, k := range map[string]*CertKeeper{"a": a, "b": b} {
		if err := verifies(t, k, bundle, clk.t); err != nil {
			t.Errorf("replica %s's leaf does not verify against the caBundle: %v", name, err)
		}
	}
	if got := bundleOf(t, c, "ambientd-readiness-gate", "someone-else.example.com"); !strings.Contains(string(got), "not ours") {
		t.Errorf("another webhook's caBundle was written: %q", got)
	}
	if got := bundleOf(t, c, "another-config", "readiness-gate.ambientd.io"); got != nil {
		t.Errorf("another configuration's caBundle was written: %q", got)
	}
}

// TestLeafRotatesBeforeExpiry: the leaf is replaced at two thirds of its
// life, by the same CA, so the configuration's caBundle does not change and
// the old and new leaves both verify; the next pass is due no later than
// the renewal.
func TestLeafRotatesBeforeExpiry(t *testing.T) {
	ctx := context.Background()
	c := newFakeCluster()
	clk := &clock{time.Now()}
	k := keeper(c, clk)
	k.LeafValidity = 30 * time.Second
	next, err := k.Reconcile(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if next > 20*time.Second {
		t.Errorf("next pass in %s: after the leaf's renewal (20 s)", next)
	}
	first, _ := k.GetCertificate(nil)
	bundle := bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")
	clk.t = clk.t.Add(19 * time.Second)
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if same, _ := k.GetCertificate(nil); same != first {
		t.Error("leaf replaced before two thirds of its life")
	}
	clk.t = clk.t.Add(2 * time.Second)
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	second, _ := k.GetCertificate(nil)
	if second == first {
		t.Fatal("leaf not replaced at two thirds of its life")
	}
	if !second.Leaf.NotAfter.After(first.Leaf.NotAfter) {
		t.Errorf("new leaf expires %s, the old %s", second.Leaf.NotAfter, first.Leaf.NotAfter)
	}
	if !bytes.Equal(bundle, bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")) {
		t.Error("a leaf rotation changed the caBundle")
	}
	if err := verifies(t, k, bundle, clk.t); err != nil {
		t.Errorf("new leaf: %v", err)
	}
}

// TestCARotationKeepsServing: at two thirds of the CA's life a new CA is
// written, the old one kept beside it; the caBundle carries both, and
// leaves are signed by the old CA until the new one has been in the
// caBundle for TrustDelay — at every step the served leaf verifies against
// the caBundle the apiserver had a moment before.
func TestCARotationKeepsServing(t *testing.T) {
	ctx := context.Background()
	c := newFakeCluster()
	clk := &clock{time.Now()}
	k := keeper(c, clk)
	k.CAValidity, k.LeafValidity = 3*time.Hour, time.Hour
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	oldBundle := bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")
	clk.t = clk.t.Add(2*time.Hour + time.Minute) // past the CA's renewal
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	newBundle := bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")
	if n := bytes.Count(newBundle, []byte("BEGIN CERTIFICATE")); n != 2 || !bytes.Contains(newBundle, oldBundle) {
		t.Fatalf("caBundle after the CA's rotation has %d certificates (want the new and the old)", n)
	}
	if err := verifies(t, k, oldBundle, clk.t); err != nil {
		t.Errorf("right after the CA's rotation the leaf must still verify against the old caBundle: %v", err)
	}
	clk.t = clk.t.Add(TrustDelay + time.Second)
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	s, _ := c.CoreV1().Secrets(testNS).Get(ctx, "ambientd-webhook-ca", metav1.GetOptions{})
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.Data[KeyCACert])
	leaf, _ := k.GetCertificate(nil)
	if _, err := leaf.Leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: k.DNSNames[0], CurrentTime: clk.t}); err != nil {
		t.Errorf("after the trust delay the leaf is not signed by the new CA: %v", err)
	}
	// Once the old CA expired it leaves the Secret and the caBundle.
	clk.t = clk.t.Add(time.Hour)
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io"), []byte("BEGIN CERTIFICATE")); n != 1 {
		t.Errorf("caBundle keeps %d certificates after the old CA expired", n)
	}
}

// TestKeeperWritesNothingItCannotOwn: a Secret under its name that holds
// something else is never overwritten, and a configuration without the
// named webhook is never written: both are errors that say so.
func TestKeeperWritesNothingItCannotOwn(t *testing.T) {
	ctx := context.Background()
	c := newFakeCluster()
	if _, err := c.CoreV1().Secrets(testNS).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "ambientd-webhook-ca"}, Data: map[string][]byte{KeyCACert: []byte("someone's"), KeyCAKey: []byte("data")},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	k := keeper(c, &clock{time.Now()})
	if _, err := k.Reconcile(ctx); err == nil || !strings.Contains(err.Error(), "ambientd-webhook-ca") {
		t.Errorf("foreign Secret: error %v", err)
	}
	s, _ := c.CoreV1().Secrets(testNS).Get(ctx, "ambientd-webhook-ca", metav1.GetOptions{})
	if string(s.Data[KeyCACert]) != "someone's" {
		t.Error("foreign Secret overwritten")
	}
	k = keeper(newFakeCluster(), &clock{time.Now()})
	k.WebhookName = "not-there.ambientd.io"
	if _, err := k.Reconcile(ctx); err == nil || !strings.Contains(err.Error(), "no webhook named not-there.ambientd.io") {
		t.Errorf("missing entry: error %v", err)
	}
	if k.Ready() {
		t.Error("ready without a caBundle in place")
	}
}

// TestConcurrentCARotationWritesOneCA: two replicas find the CA due at the
// same moment; the other one's update lands between this one's read and
// write. This one's update carries the resourceVersion it read, is refused
// (Conflict), and it then uses the CA the other wrote instead of writing a
// second one: every replica's leaf chains to the one CA in the Secret.
func TestConcurrentCARotationWritesOneCA(t *testing.T) {
	ctx := context.Background()
	c := newFakeCluster()
	clk := &clock{time.Now()}
	k := keeper(c, clk)
	k.CAValidity, k.LeafValidity = 3*time.Hour, time.Hour
	gvr := corev1.SchemeGroupVersion.WithResource("secrets")
	// The API server's optimistic concurrency, which the fake lacks: every
	// write gets a new resourceVersion, and an update that names another
	// one than the stored is a Conflict (an empty one is unconditional).
	rv := 100
	c.PrependReactor("create", "secrets", func(action k8stesting.Action) (bool, runtime.Object, error) {
		s := action.(k8stesting.CreateAction).GetObject().(*corev1.Secret).DeepCopy()
		rv++
		s.ResourceVersion, s.Namespace = fmt.Sprint(rv), testNS
		return true, s, c.Tracker().Create(gvr, s, testNS)
	})
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	clk.t = clk.t.Add(2*time.Hour + time.Minute) // the CA is due
	var theirs caPair
	raced := false
	c.PrependReactor("update", "secrets", func(action k8stesting.Action) (bool, runtime.Object, error) {
		s := action.(k8stesting.UpdateAction).GetObject().(*corev1.Secret).DeepCopy()
		if !raced { // the other replica's rotation lands first
			raced = true
			cur, _ := c.Tracker().Get(gvr, testNS, s.Name)
			other := cur.(*corev1.Secret).DeepCopy()
			var err error
			if theirs, err = newCA(k.CAValidity, clk.t); err != nil {
				t.Error(err)
			}
			other.Data = map[string][]byte{KeyCACert: theirs.certPEM, KeyCAKey: mustKeyPEM(theirs.key),
				KeyPrevCACert: other.Data[KeyCACert], KeyPrevCAKey: other.Data[KeyCAKey]}
			rv++
			other.ResourceVersion = fmt.Sprint(rv)
			if err := c.Tracker().Update(gvr, other, testNS); err != nil {
				t.Error(err)
			}
		}
		cur, err := c.Tracker().Get(gvr, testNS, s.Name)
		if err != nil {
			return true, nil, err
		}
		if s.ResourceVersion != "" && cur.(*corev1.Secret).ResourceVersion != s.ResourceVersion {
			return true, nil, apierrors.NewConflict(corev1.Resource("secrets"), s.Name, fmt.Errorf("the object has been modified"))
		}
		rv++
		s.ResourceVersion = fmt.Sprint(rv)
		return true, s, c.Tracker().Update(gvr, s, testNS)
	})
	if _, err := k.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	if !raced {
		t.Fatal("the race was not run")
	}
	s, _ := c.CoreV1().Secrets(testNS).Get(ctx, "ambientd-webhook-ca", metav1.GetOptions{})
	if !bytes.Equal(s.Data[KeyCACert], theirs.certPEM) {
		t.Fatal("the Secret's CA is not the one the other replica wrote: a second CA was written over it")
	}
	bundle := bundleOf(t, c, "ambientd-readiness-gate", "readiness-gate.ambientd.io")
	if !bytes.Contains(bundle, theirs.certPEM) {
		t.Error("the caBundle lacks the other replica's CA")
	}
	if err := verifies(t, k, bundle, clk.t); err != nil {
		t.Errorf("leaf against the caBundle: %v", err)
	}
}
