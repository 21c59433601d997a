package cases

import (
	"maps"
	"slices"
	"testing"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/test/infra/kubetest"
)

// shippedConfig is deploy/configmap.yaml's data: the settings the shipped
// policy reads (as its param) and the agent gets as its environment.
func shippedConfig(t *testing.T) map[string]string {
	return kubetest.ShippedConfig(t, "../../deploy/configmap.yaml")
}

// TestEnrollmentTable judges enrollment.yaml with the Go side: the agent's
// policy (policy.Decide) and the gate decision of admission. The
// same table runs against the shipped CEL in test/e2e.
func TestEnrollmentTable(t *testing.T) {
	e, err := LoadEnrollment()
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Cases) < 15 {
		t.Fatalf("%d cases; the table must keep at least 15", len(e.Cases))
	}
	shipped := shippedConfig(t)
	for _, c := range e.Cases {
		t.Run(c.Name, func(t *testing.T) {
			data := maps.Clone(shipped)
			maps.Copy(data, c.Settings)
			s := admission.SettingsFrom(data)
			nsLabels, _ := e.Labels(c.Pod.Namespace)
			d := s.Decide(&c.Pod, nsLabels)
			if d.Policy.InMesh != c.Enrolled || string(d.Policy.Reason) != c.Reason {
				t.Errorf("policy: in mesh %v (%s), table says %v (%s)", d.Policy.InMesh, d.Policy.Reason, c.Enrolled, c.Reason)
			}
			var got []string
			for _, g := range s.Gates(&c.Pod, d) {
				got = append(got, string(g.ConditionType))
			}
			if !slices.Equal(got, c.Gates) {
				t.Errorf("gates after admission %q, table says %q", got, c.Gates)
			}
		})
	}
}

// gatesUnder is the Go judge's gates for c under the shipped data
// overridden by settings.
func gatesUnder(e Enrollment, shipped, settings map[string]string, c EnrollmentCase) []string {
	data := maps.Clone(shipped)
	maps.Copy(data, settings)
	s := admission.SettingsFrom(data)
	nsLabels, _ := e.Labels(c.Pod.Namespace)
	var out []string
	for _, g := range s.Gates(&c.Pod, s.Decide(&c.Pod, nsLabels)) {
		out = append(out, string(g.ConditionType))
	}
	return out
}

// TestGroupsTellSettingsApart: the e2e judge changes the ConfigMap between
// groups of cases and waits until the apiserver's answers match; that is
// sound only if, under the previous group's settings, at least one case of
// the group would be answered differently (otherwise a param the apiserver
// has not picked up yet would pass for the new one).
func TestGroupsTellSettingsApart(t *testing.T) {
	e, err := LoadEnrollment()
	if err != nil {
		t.Fatal(err)
	}
	shipped := shippedConfig(t)
	groups := Groups(e.Cases)
	if len(groups[0][0].Settings) != 0 {
		t.Fatal("the table must start with the cases of the shipped settings")
	}
	for i := 1; i < len(groups); i++ {
		prev := groups[i-1][0].Settings
		if !slices.ContainsFunc(groups[i], func(c EnrollmentCase) bool {
			return !slices.Equal(gatesUnder(e, shipped, prev, c), c.Gates)
		}) {
			t.Errorf("group %d (settings %v, first case %q): every case is answered the same under the previous settings %v", i, groups[i][0].Settings, groups[i][0].Name, prev)
		}
	}
}

// TestShippedConfigIsTheDefault: the ConfigMap deploy/ ships holds the
// agent's defaults, so a cluster installed from deploy/ and `ambientd
// inject` without flags decide alike.
func TestShippedConfigIsTheDefault(t *testing.T) {
	got, want := admission.SettingsFrom(shippedConfig(t)), admission.DefaultSettings()
	if got.ConditionType != want.ConditionType || got.Policy.SystemNamespace != want.Policy.SystemNamespace ||
		!slices.Equal(got.Policy.ExcludeNamespaces, want.Policy.ExcludeNamespaces) {
		t.Errorf("shipped ConfigMap settings %+v, agent defaults %+v", got, want)
	}
}

// The annotation table (annotations.json) is judged against the agent's
// parsing by podmeta's TestAnnotationTable and against the shipped
// ValidatingAdmissionPolicy by test/e2e's TestAdmissionAnnotationTable.
