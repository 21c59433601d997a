package kube

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
)

// EventSink is the record.EventSink of client-go's Event recorder (whose
// correlator aggregates repeated Events into one with a count and
// rate-limits them per object): each Event is created, updated or patched
// (strategic merge) in its own namespace, as client-go's
// typedcorev1.EventSinkImpl over Events("") does. core/v1 Events, not
// events.k8s.io: what the recorder writes and the agent's RBAC allows.
type EventSink struct {
	Client CoreV1Interface
}

var _ record.EventSink = EventSink{}

// Create creates event in its namespace.
func (s EventSink) Create(event *corev1.Event) (*corev1.Event, error) {
	return s.Client.Events(event.Namespace).Create(context.Background(), event, metav1.CreateOptions{})
}

// Update replaces event (the recorder's fallback when a patch failed).
func (s EventSink) Update(event *corev1.Event) (*corev1.Event, error) {
	return s.Client.Events(event.Namespace).Update(context.Background(), event, metav1.UpdateOptions{})
}

// Patch applies the recorder's strategic merge patch (count, last
// timestamp, message) to event.
func (s EventSink) Patch(event *corev1.Event, data []byte) (*corev1.Event, error) {
	return s.Client.Events(event.Namespace).Patch(context.Background(), event.Name, types.StrategicMergePatchType, data, metav1.PatchOptions{})
}

// EventSource is the source of every Event the agent records (on pods and
// on its node).
const EventSource = "ambientd"

// Events is the process's one Event broadcaster: every part records through
// Recorder, and Run sends what they record to the API. client-go's
// correlator aggregates similar Events and rate-limits them per object (a
// spam filter), so a pod failing in a loop cannot flood the API.
type Events struct {
	client Interface
	host   string
	b      record.EventBroadcaster
	rec    record.EventRecorder
}

// NewEvents returns the broadcaster of the agent on host; nothing is sent
// until Run.
func NewEvents(client Interface, host string) *Events {
	b := record.NewBroadcaster()
	return &Events{client: client, host: host, b: b, rec: b.NewRecorder(NewScheme(), corev1.EventSource{Component: EventSource, Host: host})}
}

// Recorder records Events; they reach the API while Run runs (Events
// recorded before or after are dropped: they describe nothing the API would
// not hear about again).
func (e *Events) Recorder() record.EventRecorder { return e.rec }

// RecorderAs records Events whose source is component (on host) through
// the same broadcaster: for a part whose Events keep another project's
// source name (the repair controller's, Istio's cni-repair).
func (e *Events) RecorderAs(component string) record.EventRecorder {
	return e.b.NewRecorder(NewScheme(), corev1.EventSource{Component: component, Host: e.host})
}

// Run sends recorded Events to the API until ctx ends, then shuts the
// broadcaster down (what is queued is still sent). Call it once.
func (e *Events) Run(ctx context.Context) error {
	e.b.StartRecordingToSink(EventSink{Client: e.client.CoreV1()})
	<-ctx.Done()
	e.b.Shutdown()
	return nil
}

// EventInvalidSetting is the node Event of an agent that cannot start
// because a setting is refused.
const EventInvalidSetting = "InvalidSetting"

// ReportStartFailure records a Warning Event on node that the agent could
// not start and why (a refused setting): a crash-looping agent's pod logs
// are one place to look, `kubectl describe node` is where an operator looks
// first. It writes one Event directly (the broadcaster is not running) and
// gives up when ctx ends.
func ReportStartFailure(ctx context.Context, client Interface, node, component, why string) error {
	now := metav1.NewTime(time.Now())
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: node + ".", Namespace: metav1.NamespaceDefault},
		InvolvedObject: corev1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: node, UID: types.UID(node)},
		Reason:         EventInvalidSetting,
		Message:        "ambientd cannot start: " + why,
		Type:           corev1.EventTypeWarning,
		Source:         corev1.EventSource{Component: component, Host: node},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
	}
	_, err := client.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{})
	return err
}
