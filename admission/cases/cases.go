// Package cases holds the two shared case tables of the pod admission
// policies (deploy/pod-admission.yaml): enrollment.yaml (which pods get the
// readiness gate) and annotations.yaml (which mesh annotation values are
// accepted). Each table is judged twice — by the agent's Go code in unit
// tests and by the shipped policies on a real kube-apiserver in test/e2e —
// so the CEL and the Go code cannot drift apart unnoticed.
package cases

import (
	_ "embed"
	"fmt"
	"maps"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

//go:embed enrollment.yaml
var enrollmentYAML []byte

//go:embed annotations.yaml
var annotationsYAML []byte

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
	// Enrolled and Reason are nodeagent/policy's verdict.
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

// AnnotationCase is one annotation value and whether it is accepted.
type AnnotationCase struct {
	Annotation string `json:"annotation"`
	Value      string `json:"value"`
	Valid      bool   `json:"valid"`
}

// Name names the case in test output.
func (c AnnotationCase) Name() string { return fmt.Sprintf("%s=%q", c.Annotation, c.Value) }

// LoadAnnotations parses annotations.yaml.
func LoadAnnotations() ([]AnnotationCase, error) {
	var t struct {
		Cases []AnnotationCase `json:"cases"`
	}
	if err := yaml.UnmarshalStrict(annotationsYAML, &t); err != nil {
		return nil, fmt.Errorf("annotations.yaml: %w", err)
	}
	return t.Cases, nil
}
