package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"

	"github.com/ambientd/ambientd/cniapi"
)

// EventAgentAbsent is the node Event that tells what the plugin did while
// no agent answered on its socket.
const EventAgentAbsent = "AgentWasAbsent"

// absenceReport turns the plugin's absence record (cniapi.AbsenceRecord,
// in the CNI socket's dir) into a node Event, a log line and the counter
// ambientd_cni_adds_without_agent_total, once at the agent's start, and
// removes it.
type absenceReport struct {
	path     string
	node     string
	recorder record.EventRecorder
	log      *slog.Logger
	adds     *prometheus.CounterVec
}

func newAbsenceReport(cniSocket, node string, recorder record.EventRecorder, reg prometheus.Registerer, log *slog.Logger) (*absenceReport, error) {
	r := &absenceReport{
		path: filepath.Join(filepath.Dir(cniSocket), cniapi.AbsenceFile), node: node, recorder: recorder, log: log,
		adds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ambientd_cni_adds_without_agent_total",
			Help: "CNI ADDs the plugin decided while no agent answered, as reported by the next agent (decision: refused, passed, uninstalled).",
		}, []string{"decision"}),
	}
	for _, d := range []string{"refused", "passed", "uninstalled"} {
		r.adds.WithLabelValues(d)
	}
	if err := reg.Register(r.adds); err != nil {
		return nil, fmt.Errorf("register absence metric: %w", err)
	}
	return r, nil
}

// message is the Event's text for rec (pure).
func absenceMessage(rec cniapi.AbsenceRecord, now time.Time) string {
	// Away from the last sign of an agent (its lease's renewal) to this
	// agent's start; the first ADD that found none when the lease was
	// unreadable.
	since := rec.AgentLastSeen
	if since.IsZero() || since.After(rec.First) {
		since = rec.First
	}
	waited := fmt.Sprint(len(rec.Waiting))
	if len(rec.Waiting) >= cniapi.MaxAbsenceWaiting {
		waited += "+"
	}
	msg := fmt.Sprintf("the node ran %v without the mesh agent (last seen %s, first pod without it %s, last %s); %s pods waited (%d sandbox attempts refused); %d outside the mesh started",
		now.Sub(since).Round(time.Second), since.UTC().Format(time.RFC3339), rec.First.UTC().Format(time.RFC3339), rec.Last.UTC().Format(time.RFC3339), waited, rec.Refused, rec.Passed)
	if rec.Uninstalled > 0 {
		msg += fmt.Sprintf("; %d finished an uninstall", rec.Uninstalled)
	}
	if rec.AwayLong {
		msg += "; the agent was away for longer than the install lease's TTL"
	}
	if n := len(rec.Recent); n > 0 {
		last := rec.Recent[n-1]
		msg += fmt.Sprintf("; last: %s/%s: %s", last.Namespace, last.Name, last.Reason)
	}
	return msg
}

// report reads, reports and removes the record. A missing record is the
// common case: the plugin never found the agent away.
func (r *absenceReport) report() error {
	f, err := os.Open(r.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	data, err := io.ReadAll(io.LimitReader(f, 256<<10))
	f.Close()
	if err != nil {
		return err
	}
	if err := os.Remove(r.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if len(data) == 0 {
		return nil
	}
	var rec cniapi.AbsenceRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return fmt.Errorf("the plugin's absence record %s is not valid JSON: %w", r.path, err)
	}
	r.adds.WithLabelValues("refused").Add(float64(rec.Refused))
	r.adds.WithLabelValues("passed").Add(float64(rec.Passed))
	r.adds.WithLabelValues("uninstalled").Add(float64(rec.Uninstalled))
	msg := absenceMessage(rec, time.Now())
	r.log.Warn("the plugin decided pods while no agent answered", "reason", msg, "path", r.path)
	ref := &corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: r.node, UID: types.UID(r.node)}
	r.recorder.Event(ref, corev1.EventTypeWarning, EventAgentAbsent, msg)
	return nil
}

// Run reports once, then waits for ctx: a record the plugin writes while
// this agent runs means it did not reach this agent's socket, and is
// reported at the next start.
func (r *absenceReport) Run(ctx context.Context) error {
	if err := r.report(); err != nil {
		r.log.Warn("cannot report what the plugin did while no agent answered", "path", r.path, "error", err)
	}
	<-ctx.Done()
	return nil
}
