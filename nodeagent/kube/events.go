package kube

import (
	"context"

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
