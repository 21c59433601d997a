package webhook

import (
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writePair writes a fresh leaf (signed by a fresh CA) as cert-manager's
// mounted Secret holds it, and returns its serial.
func writePair(t *testing.T, dir string) string {
	t.Helper()
	ca, err := newCA(24*time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	l, _, err := issueLeaf(ca, []string{"ambientd-webhook.istio-system.svc"}, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	key, err := x509.MarshalPKCS8PrivateKey(l.cert.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	// As kubelet updates a Secret volume: new files, then swapped in.
	for name, b := range map[string][]byte{
		"tls.crt": pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: l.cert.Certificate[0]}),
		"tls.key": pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key}),
	} {
		tmp := filepath.Join(dir, name+".tmp")
		if err := os.WriteFile(tmp, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return l.cert.Leaf.SerialNumber.String()
}

// TestFileCertFollowsRenewals: the certificate cert-manager keeps in the
// mounted files is served, a renewal (new files) is served at the next
// handshake without a restart, and files that stop loading (a half-written
// pair) keep the last good certificate instead of failing handshakes.
func TestFileCertFollowsRenewals(t *testing.T) {
	dir := t.TempDir()
	f := &FileCert{CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key")}
	if _, err := f.GetCertificate(nil); err == nil || f.Ready() {
		t.Fatal("no files: a certificate served")
	}
	first := writePair(t, dir)
	serial := func() string {
		t.Helper()
		f.checked = time.Time{} // past the once-a-second check
		c, err := f.GetCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		leaf, err := x509.ParseCertificate(c.Certificate[0])
		if err != nil {
			t.Fatal(err)
		}
		return leaf.SerialNumber.String()
	}
	if got := serial(); got != first {
		t.Fatalf("serving %s, the files hold %s", got, first)
	}
	second := writePair(t, dir)
	if got := serial(); got != second {
		t.Fatalf("after the renewal serving %s, the files hold %s", got, second)
	}
	if err := os.WriteFile(f.KeyFile, []byte("half written"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := serial(); got != second {
		t.Errorf("a broken key file: serving %s, want the last good %s", got, second)
	}
}
