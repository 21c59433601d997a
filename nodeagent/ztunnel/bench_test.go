package ztunnel

import (
	"context"
	"fmt"
	"testing"

	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// BenchmarkAddAck measures AddWorkload round trips (send with fd, ack)
// against the emulator over the real socket; add+del also listens in and
// leaves the netns on every cycle.
func BenchmarkAddAck(b *testing.B) {
	for _, bc := range []struct {
		name      string
		netnsMode bool
		del       bool
	}{
		{"add", false, false},
		{"add+del", false, true},
		{"add+del/netns-mode", true, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			n := newNetns(b)
			s, _ := runServer(b, Config{}, &source{})
			e, _ := runEmu(b, ztunnelemu.Config{SocketPath: s.cfg.SocketPath, NetnsMode: bc.netnsMode, MaxRecords: 1000})
			waitSnapshot(b, e, 1)
			testutil.WaitFor(b, "acked", func() bool { return s.Status().SnapshotAcked })
			ctx := context.Background()
			i := 0
			for b.Loop() {
				// Add-only cycles through 100 uids: the emulator, like
				// ztunnel, keeps one netns fd per workload, so unbounded
				// uids would measure the fd limit, not the round trip.
				// Re-adding a uid with the same netns is acked as OK.
				uid := fmt.Sprint("p", i%100)
				if bc.del {
					uid = fmt.Sprint("p", i)
				}
				i++
				if err := s.AddWorkload(ctx, wl(uid), n.File); err != nil {
					b.Fatal(err)
				}
				if bc.del {
					if err := s.DelWorkload(ctx, uid); err != nil {
						b.Fatal(err)
					}
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "adds/s")
		})
	}
}
