package webhook

import (
	"crypto/tls"
	"fmt"
	"os"
	"sync"
	"time"
)

// FileCert serves a certificate someone else keeps in files (cert-manager's
// Secret mounted into the pod: kubelet replaces the files when the
// Certificate is renewed). The files are read again at the first handshake
// after either changed (checked at most once a second), so a renewal is
// served without a restart; a pair that fails to load keeps the last good
// one.
type FileCert struct {
	CertFile, KeyFile string

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   string
	checked time.Time
}

// GetCertificate is the tls.Config hook.
func (f *FileCert) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.cert != nil && time.Since(f.checked) < time.Second {
		return f.cert, nil
	}
	f.checked = time.Now()
	stamp, err := f.fileStamp()
	if err == nil && stamp == f.stamp && f.cert != nil {
		return f.cert, nil
	}
	c, lerr := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	switch {
	case lerr == nil:
		f.cert, f.stamp = &c, stamp
	case f.cert == nil:
		return nil, fmt.Errorf("ambientd webhook: serving certificate: %w", lerr)
	}
	return f.cert, nil
}

// Ready reports whether the files hold a usable pair.
func (f *FileCert) Ready() bool {
	_, err := f.GetCertificate(nil)
	return err == nil
}

func (f *FileCert) fileStamp() (string, error) {
	var s string
	for _, p := range []string{f.CertFile, f.KeyFile} {
		fi, err := os.Stat(p)
		if err != nil {
			return "", err
		}
		s += fmt.Sprintf("%d/%d;", fi.ModTime().UnixNano(), fi.Size())
	}
	return s, nil
}
