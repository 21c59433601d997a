package webhook

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"
)

// The certificates themselves: the CA kept in the Secret (its PEM form
// there), and the leaves each replica signs with it in memory.

// caPair is a CA certificate and key.
type caPair struct {
	cert        *x509.Certificate
	key         crypto.Signer
	certPEM     []byte
	fingerprint [32]byte
	renewAt     time.Time // two thirds into its life
}

type caSet struct {
	cur  caPair
	prev *caPair // the predecessor, while it has not expired
}

// bundle is the caBundle: every CA a served leaf may chain to.
func (s caSet) bundle() []byte {
	if s.prev == nil {
		return s.cur.certPEM
	}
	return append(append([]byte{}, s.cur.certPEM...), s.prev.certPEM...)
}

// parseCASecret reads the Secret's CA (have=false: an empty Secret, as the
// chart ships it) and its predecessor while it has not expired.
func parseCASecret(data map[string][]byte, now time.Time) (caSet, bool, error) {
	if len(data[KeyCACert]) == 0 && len(data[KeyCAKey]) == 0 {
		return caSet{}, false, nil
	}
	cur, err := parseCA(data[KeyCACert], data[KeyCAKey])
	if err != nil {
		return caSet{}, false, fmt.Errorf("%s/%s: %w", KeyCACert, KeyCAKey, err)
	}
	set := caSet{cur: cur}
	if len(data[KeyPrevCACert]) > 0 {
		if prev, err := parseCA(data[KeyPrevCACert], data[KeyPrevCAKey]); err == nil && now.Before(prev.cert.NotAfter) {
			set.prev = &prev
		}
	}
	return set, true, nil
}

func parseCA(certPEM, keyPEM []byte) (caPair, error) {
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return caPair{}, errors.New("not PEM")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return caPair{}, err
	}
	k, err := x509.ParsePKCS8PrivateKey(kb.Bytes)
	if err != nil {
		return caPair{}, err
	}
	key, ok := k.(crypto.Signer)
	if !ok || !cert.IsCA {
		return caPair{}, errors.New("not a CA certificate and key")
	}
	return newPair(cert, key), nil
}

func newPair(cert *x509.Certificate, key crypto.Signer) caPair {
	life := cert.NotAfter.Sub(cert.NotBefore)
	return caPair{
		cert: cert, key: key, fingerprint: sha256.Sum256(cert.Raw),
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}),
		renewAt: cert.NotBefore.Add(life * 2 / 3),
	}
}

// backdate covers clocks a little behind ours.
const backdate = time.Minute

func newCA(validity time.Duration, now time.Time) (caPair, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return caPair{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "ambientd-webhook-ca"},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return caPair{}, fmt.Errorf("create CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return caPair{}, err
	}
	return newPair(cert, key), nil
}

func issueLeaf(ca caPair, dnsNames []string, validity time.Duration, now time.Time) (*leafCert, time.Time, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, time.Time{}, err
	}
	notAfter := now.Add(validity)
	if notAfter.After(ca.cert.NotAfter) {
		notAfter = ca.cert.NotAfter // never outlive the signer
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: dnsNames[0]},
		DNSNames:     dnsNames,
		NotBefore:    now.Add(-backdate),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("sign leaf: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, time.Time{}, err
	}
	return &leafCert{
		cert:    tls.Certificate{Certificate: [][]byte{der, ca.cert.Raw}, PrivateKey: key, Leaf: leaf},
		signer:  ca.fingerprint,
		renewAt: now.Add(notAfter.Sub(now) * 2 / 3),
	}, notAfter, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return n
}

func mustKeyPEM(k crypto.Signer) []byte {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		panic(err) // an ECDSA key we made
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
}
