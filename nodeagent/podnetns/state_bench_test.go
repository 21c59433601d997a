package podnetns

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/ambientd/ambientd/iptables"
)

// BenchmarkStatePut: what a CNI ADD's state-file record costs on a node
// that already holds 1,000 pods (each op records one more pod and forgets
// it again, so the file stays at 1,000).
func BenchmarkStatePut(b *testing.B) {
	s, err := OpenState(filepath.Join(b.TempDir(), "pods.json"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	h, err := Open("/proc/self/ns/net")
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	for i := range 1000 {
		if err := s.Put(fmt.Sprintf("0f3c2a4e-0000-4000-8000-%012d", i), h, iptables.PodOptions{DNSCapture: true}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if err := s.Put("0f3c2a4e-ffff-4000-8000-000000000000", h, iptables.PodOptions{DNSCapture: true}); err != nil {
			b.Fatal(err)
		}
		if err := s.Delete("0f3c2a4e-ffff-4000-8000-000000000000"); err != nil {
			b.Fatal(err)
		}
	}
}
