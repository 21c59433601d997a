package daemon

import (
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/cniapi"
)

// The next agent turns the plugin's record into one node Event, the
// counter and a removed file; without a record it says nothing.
func TestAbsenceReport(t *testing.T) {
	dir := t.TempDir()
	rec := record.NewFakeRecorder(10)
	reg := prometheus.NewRegistry()
	r, err := newAbsenceReport(filepath.Join(dir, "cni.sock"), "n1", rec, reg, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	if err := r.report(); err != nil {
		t.Fatalf("no record: %v", err)
	}
	if len(rec.Events) != 0 {
		t.Fatalf("an Event without a record: %v", <-rec.Events)
	}
	now := time.Now()
	b, _ := json.Marshal(cniapi.AbsenceRecord{Version: cniapi.AbsenceVersion, AgentLastSeen: now.Add(-14 * time.Minute), First: now.Add(-13 * time.Minute), Last: now.Add(-time.Minute),
		Refused: 37, Passed: 12, Waiting: []string{"shop/web", "shop/api"}, Recent: []cniapi.AbsenceAttempt{{Namespace: "shop", Name: "web", Reason: "in the mesh"}}})
	path := filepath.Join(dir, cniapi.AbsenceFile)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := r.report(); err != nil {
		t.Fatal(err)
	}
	ev := <-rec.Events
	for _, want := range []string{"Warning " + EventAgentAbsent, "ran 14m0s without the mesh agent", "2 pods waited (37 sandbox attempts refused)", "12 outside the mesh started", "shop/web: in the mesh"} {
		if !strings.Contains(ev, want) {
			t.Errorf("Event %q does not say %q", ev, want)
		}
	}
	if got := testutil.ToFloat64(r.adds.WithLabelValues("refused")); got != 37 {
		t.Errorf("refused counter %v", got)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("the record is still there: %v", err)
	}
}
