package ztunnel

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

func TestMetrics(t *testing.T) {
	n := newNetns(t)
	s, _ := runServer(t, Config{}, &source{})
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(s.Metrics()); err != nil {
		t.Fatal(err)
	}
	if err := s.AddWorkload(ctxT(t), wl("x"), n.File); !errors.Is(err, ErrNoZtunnel) {
		t.Fatal(err)
	}
	e, _ := runEmu(t, ztunnelemu.Config{SocketPath: s.cfg.SocketPath})
	waitSnapshot(t, e, 1)
	testutil.WaitFor(t, "acked", func() bool { return s.Status().SnapshotAcked })
	e.SetNack("y", "no")
	if err := s.AddWorkload(ctxT(t), wl("x"), n.File); err != nil {
		t.Fatal(err)
	}
	_ = s.AddWorkload(ctxT(t), wl("y"), n.File)

	m := s.Metrics()
	for _, tc := range []struct {
		c    prometheus.Metric
		want float64
	}{
		{m.connections, 1},
		{m.accepted, 1},
		{m.requests.WithLabelValues("add", "ok"), 1},
		{m.requests.WithLabelValues("add", "nack"), 1},
		{m.requests.WithLabelValues("add", "no_ztunnel"), 1},
		{m.requests.WithLabelValues("snapshot_sent", "ok"), 1},
	} {
		var d dto.Metric
		if err := tc.c.Write(&d); err != nil {
			t.Fatal(err)
		}
		got := d.GetCounter().GetValue() + d.GetGauge().GetValue()
		if got != tc.want {
			t.Errorf("%v: got %v, want %v", tc.c.Desc(), got, tc.want)
		}
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]int{}
	for _, f := range families {
		series[f.GetName()] = len(f.GetMetric())
	}
	// Ack latency observed for snapshot_sent and add (ok and nack alike).
	if series["ambientd_ztunnel_ack_duration_seconds"] != 2 || series["ambientd_ztunnel_requests_total"] != 4 {
		t.Fatalf("series: %v", series)
	}
}
