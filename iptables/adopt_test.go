package iptables

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ambientd/ambientd/iptables/internal/nftables"
)

// istioNFTPod is a pod as Istio's agent (1.28+, native nftables, IPv6 and
// DNS capture on) leaves it, written in the syntax Istio's own golden files
// use, not ours.
const istioNFTPod = `add table inet istio-ambient-nat
add chain inet istio-ambient-nat prerouting { type nat hook prerouting priority -100 ; }
add chain inet istio-ambient-nat output { type nat hook output priority -100 ; }
add chain inet istio-ambient-nat istio-prerouting
add chain inet istio-ambient-nat istio-output
add rule inet istio-ambient-nat output jump istio-output
add rule inet istio-ambient-nat prerouting jump istio-prerouting
add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip saddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-prerouting meta l4proto tcp ip6 saddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr 169.254.7.127 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip6 daddr fd16:9254:7127:1337:ffff:ffff:ffff:ffff counter accept
add rule inet istio-ambient-nat istio-prerouting ip daddr != 127.0.0.1/32 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006
add rule inet istio-ambient-nat istio-prerouting ip6 daddr != ::1/128 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006
add rule inet istio-ambient-nat istio-output oifname != lo mark and 0xfff != 0x539 udp dport 53 counter redirect to :15053
add rule inet istio-ambient-nat istio-output ip daddr != 127.0.0.1/32 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053
add rule inet istio-ambient-nat istio-output ip6 daddr != ::1/128 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053
add rule inet istio-ambient-nat istio-output meta l4proto tcp mark and 0xfff == 0x111 counter accept
add rule inet istio-ambient-nat istio-output oifname lo ip daddr != 127.0.0.1/32 counter accept
add rule inet istio-ambient-nat istio-output oifname lo ip6 daddr != ::1/128 counter accept
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip daddr != 127.0.0.1/32 mark and 0xfff != 0x539 counter redirect to :15001
add rule inet istio-ambient-nat istio-output meta l4proto tcp ip6 daddr != ::1/128 mark and 0xfff != 0x539 counter redirect to :15001
add table inet istio-ambient-mangle
add chain inet istio-ambient-mangle prerouting { type filter hook prerouting priority -150 ; }
add chain inet istio-ambient-mangle output { type route hook output priority -150 ; }
add chain inet istio-ambient-mangle istio-prerouting
add chain inet istio-ambient-mangle istio-output
add rule inet istio-ambient-mangle prerouting jump istio-prerouting
add rule inet istio-ambient-mangle output jump istio-output
add rule inet istio-ambient-mangle istio-prerouting meta mark & 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 | 0x111
add rule inet istio-ambient-mangle istio-output ct mark and 0xfff == 0x111 counter meta mark set ct mark
add table inet istio-ambient-raw
add chain inet istio-ambient-raw prerouting { type filter hook prerouting priority -300 ; }
add chain inet istio-ambient-raw output { type filter hook output priority -300 ; }
add chain inet istio-ambient-raw istio-prerouting
add chain inet istio-ambient-raw istio-output
add rule inet istio-ambient-raw prerouting jump istio-prerouting
add rule inet istio-ambient-raw output jump istio-output
add rule inet istio-ambient-raw istio-output udp dport 53 meta mark and 0xfff == 0x539 counter ct zone set 1
add rule inet istio-ambient-raw istio-prerouting udp sport 53 meta mark and 0xfff != 0x539 counter ct zone set 1
`

// TestAdoptIstioNFTPod: a pod Istio's agent enrolled in native-nftables mode
// verifies clean against our rules (same tables, chains and expressions) and
// ApplyPod adopts it without rewriting anything. While connections run
// continuously, even repeated rewrites (the pod's options flipping, so every
// apply replaces the tables' contents) never let one through uncaptured:
// each rewrite is one atomic transaction.
func TestAdoptIstioNFTPod(t *testing.T) {
	requireNFT(t)
	ctx := testCtx(t)
	cfg := Config{IPv6: true}
	opts := PodOptions{DNSCapture: true}
	m := newTestManager(t, ModeNFTables, cfg)
	pod, peer := newNS(t), newNS(t)
	vethPair(t, pod, peer, []netip.Addr{podIP, podIP6}, []netip.Addr{peerIP, peerIP6})
	listen(t, pod, "tcp4", fmt.Sprintf(":%d", OutboundPort), "ztunnel-outbound", true)
	listen(t, peer, "tcp4", fmt.Sprintf(":%d", peerPort), "peer", false)

	path := filepath.Join(t.TempDir(), "istio-pod.nft")
	if err := os.WriteFile(path, []byte(istioNFTPod), 0o644); err != nil {
		t.Fatal(err)
	}
	nsRun(t, pod, "nft", "-f", path)
	nsRun(t, pod, "ip", "rule", "add", "pref", "32764", "fwmark", "0x111/0xfff", "lookup", "100")
	nsRun(t, pod, "ip", "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	nsRun(t, pod, "ip", "-6", "route", "add", "local", "::/0", "dev", "lo", "table", "100")
	nsRun(t, pod, "ip", "-6", "rule", "add", "pref", "32764", "fwmark", "0x111/0xfff", "lookup", "100")

	dst := netip.AddrPortFrom(peerIP, peerPort)
	want := "ztunnel-outbound|" + dst.String() + "|" + podIP.String()
	if got, err := ask(pod, "tcp", dst, dialOpts{}); err != nil || got != want {
		t.Fatalf("Istio's rules do not capture: %q %v", got, err)
	}
	if d, err := m.VerifyPod(ctx, pod, opts); err != nil || !d.Empty() {
		t.Fatalf("an Istio-enrolled pod does not verify clean: %v\n%s", err, d)
	}
	before := nftHandles(t, pod)

	// Connections from the pod, back to back on four workers, the whole time.
	var (
		stop         atomic.Bool
		total, wrong atomic.Int64
		firstWrong   atomic.Value
		wg           sync.WaitGroup
	)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				got, err := ask(pod, "tcp", dst, dialOpts{})
				total.Add(1)
				if err != nil || got != want {
					wrong.Add(1)
					firstWrong.CompareAndSwap(nil, fmt.Sprintf("%q %v", got, err))
				}
			}
		}()
	}
	if err := m.ApplyPod(ctx, pod, opts); err != nil {
		t.Fatal(err)
	}
	if after := nftHandles(t, pod); after != before {
		t.Errorf("adopting the Istio-enrolled pod rewrote its rules:\n%s\nvs\n%s", before, after)
	}
	for i := range 40 {
		o := opts
		o.DNSCapture = i%2 == 0
		if err := m.ApplyPod(ctx, pod, o); err != nil {
			t.Fatal(err)
		}
	}
	stop.Store(true)
	wg.Wait()
	if wrong.Load() != 0 {
		t.Fatalf("%d of %d connections not captured during adoption and rewrites; first: %v", wrong.Load(), total.Load(), firstWrong.Load())
	}
	t.Logf("%d connections, all captured, across adoption and 40 atomic rewrites", total.Load())
	if total.Load() < 8 {
		t.Fatalf("only %d connections overlapped the rewrites", total.Load())
	}
	if d, err := m.VerifyPod(ctx, pod, PodOptions{DNSCapture: false}); err != nil || !d.Empty() {
		t.Fatalf("after the rewrites: %v %s", err, d)
	}
	if s := nftList(t, pod, nftables.PodTables()...); strings.Contains(s, "15053") {
		t.Fatalf("last rewrite (DNS off) not in place:\n%s", s)
	}
}
