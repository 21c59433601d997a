// Package cases holds the two shared case tables of the pod admission
// policies (deploy/pod-admission.yaml): enrollment.yaml (which pods get the
// readiness gate) and annotations.json (which mesh annotation values are
// accepted). Each table is judged twice — by the agent's Go code in unit
// tests and by the shipped policies on a real kube-apiserver in test/e2e —
// so the CEL and the Go code cannot drift apart unnoticed.
package cases

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

//go:embed enrollment.yaml
var enrollmentYAML []byte

//go:embed annotations.json
var annotationsJSON []byte

// Namespace is a namespace the enrollment cases refer to.
type Namespace struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels,omitempty"`
}

// EnrollmentCase is one pod and what admission and the agent make of it.
type EnrollmentCase struct {
	Name string `json:"name"`
	// Settings override the shipped ConfigMap's data for this case.
	Settings map[string]string `json:"settings,omitempty"`
	// Pod is the pod as submitted (no name, no containers).
	Pod corev1.Pod `json:"pod"`
	// Enrolled and Reason are policy's verdict.
	Enrolled bool   `json:"enrolled"`
	Reason   string `json:"reason"`
	// Gates are spec.readinessGates' condition types after admission.
	Gates []string `json:"gates"`
}

// Enrollment is enrollment.yaml.
type Enrollment struct {
	Namespaces []Namespace      `json:"namespaces"`
	Cases      []EnrollmentCase `json:"cases"`
}

// Labels returns the labels of the table's namespace name.
func (e Enrollment) Labels(name string) (map[string]string, error) {
	for _, n := range e.Namespaces {
		if n.Name == name {
			return n.Labels, nil
		}
	}
	return nil, fmt.Errorf("enrollment cases: namespace %q is not in the table", name)
}

// LoadEnrollment parses enrollment.yaml (strictly: a misspelt field is an
// error, not a silently ignored case property).
func LoadEnrollment() (Enrollment, error) {
	var e Enrollment
	if err := yaml.UnmarshalStrict(enrollmentYAML, &e); err != nil {
		return e, fmt.Errorf("enrollment.yaml: %w", err)
	}
	for _, c := range e.Cases {
		if _, err := e.Labels(c.Pod.Namespace); err != nil {
			return e, fmt.Errorf("case %q: %w", c.Name, err)
		}
	}
	return e, nil
}

// Groups splits cases into runs of consecutive cases with the same settings,
// in table order: the e2e judge changes the ConfigMap once per group.
func Groups(cs []EnrollmentCase) [][]EnrollmentCase {
	var out [][]EnrollmentCase
	for i, c := range cs {
		if i == 0 || !maps.Equal(c.Settings, cs[i-1].Settings) {
			out = append(out, nil)
		}
		out[len(out)-1] = append(out[len(out)-1], c)
	}
	return out
}

// AnnotationCase is one case of annotations.json: a pod's annotations, the
// ones the agent calls invalid (podopts.ValidateAnnotations), and
// the capture options it derives for a new pod on a node with DNS capture on.
// An admission policy enforcing the agent's rules must admit exactly the
// cases whose Invalid is empty.
type AnnotationCase struct {
	Name        string            `json:"name"`
	Annotations map[string]string `json:"annotations"`
	Invalid     []string          `json:"invalid"`
	Options     struct {
		DNSCapture        bool   `json:"dnsCapture"`
		BypassInbound     bool   `json:"bypassInbound"`
		RerouteInterfaces string `json:"rerouteInterfaces"`
	} `json:"options"`
}

// Valid reports whether the agent accepts every annotation of the case.
func (c AnnotationCase) Valid() bool { return len(c.Invalid) == 0 }

// LoadAnnotations parses annotations.json: the one table of the agent's
// annotation rules (podmeta tests it against the Go parsing, test/e2e
// against the shipped ValidatingAdmissionPolicy).
func LoadAnnotations() ([]AnnotationCase, error) {
	var t struct {
		About string           `json:"about"`
		Cases []AnnotationCase `json:"cases"`
	}
	if err := json.Unmarshal(annotationsJSON, &t); err != nil {
		return nil, fmt.Errorf("annotations.json: %w", err)
	}
	return t.Cases, nil
}
