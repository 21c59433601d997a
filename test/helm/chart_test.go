package helm

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/lint/support"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/test/helm/chartrender"
)

const (
	deployDir = "../../deploy"
	chartDir  = "../../deploy/helm/ambientd"
)

// valuesFiles are the real-world values files of testdata/values.
func valuesFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("testdata/values/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no values files in testdata/values: %v", err)
	}
	return files
}

// render renders our chart and decodes its objects.
func render(t *testing.T, o chartrender.Options) []*unstructured.Unstructured {
	t.Helper()
	rs, err := chartrender.Render(chartDir, o)
	if err != nil {
		t.Fatalf("render %v: %v", o, err)
	}
	objs, err := chartrender.Objects(rs)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// `helm lint` (Helm's linter, the values schema included) passes with no
// warning for every values file.
func TestChartLintsCleanWithEachValuesFile(t *testing.T) {
	for _, f := range append([]string{""}, valuesFiles(t)...) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			var files []string
			if f != "" {
				files = []string{f}
			}
			vals, err := chartrender.Values(files, nil)
			if err != nil {
				t.Fatal(err)
			}
			l := lint.RunAll(chartDir, vals, "istio-system")
			for _, m := range l.Messages {
				if m.Severity >= support.WarningSev {
					t.Errorf("helm lint: %s", m)
				}
			}
		})
	}
}

// An unknown or misspelled value is an error naming it, not silently
// ignored; so are values ambientd cannot honour. Values that end up inside
// the admission policy's CEL are refused unless they are what they claim
// (a label key, a container name): a quote cannot widen the policy.
func TestBadValuesFailWithAClearError(t *testing.T) {
	for _, tt := range []struct {
		name string
		set  []string
		want string
	}{
		{"misspelled top-level key", []string{"cniBinDr=/opt/cni/bin"}, "cniBinDr"},
		{"misspelled ambient key", []string{"ambient.dnsCaptur=false"}, "dnsCaptur"},
		{"misspelled global key", []string{"global.nativeNftable=true"}, "nativeNftable"},
		{"unknown key of ambientd's own", []string{"ambientd.imagee=x"}, "imagee"},
		{"unknown key under cni:", []string{"cni.excludeNamespace=x"}, "excludeNamespace"},
		{"ambientd config outside AMBIENTD_*", []string{"ambientd.config.PATH=/tmp"}, "PATH"},
		{"unknown platform", []string{"global.platform=gkee"}, "/global/platform"},
		{"another profile", []string{"profile=demo"}, "/profile"},
		{"defaults prefix", []string{"defaults.hub=x"}, "defaults"},
		{"ambient off", []string{"ambient.enabled=false"}, "ambient.enabled=false"},
		{"other enablement selectors", []string{"ambient.enablementSelectors[0].podSelector.matchLabels.mesh=yes"}, "enablementSelectors"},
		{"unknown log level", []string{"logging.level=verbose"}, "verbose"},
		{"wrong type", []string{"ambient.ipv6=maybe"}, "ipv6"},
		{"bad namespace name", []string{"excludeNamespaces[0]=Kube_System"}, "excludeNamespaces"},
		{"CEL injection through the taint key", []string{"ambientd.taintKey=x' || true || 'y"}, "taintKey"},
		// The attack: the agent removes this taint from its node; a key
		// outside the mesh's would let a compromised node attract
		// workloads that were kept away.
		{"taint key outside the mesh", []string{"ambientd.taintKey=dedicated"}, "taintKey"},
		{"a device's taint key", []string{"ambientd.taintKey=nvidia.com/gpu"}, "taintKey"},
		{"CEL injection through the broken-pod label value", []string{"repair.brokenPodLabelValue=true' || true || '"}, "brokenPodLabelValue"},
		{"CEL injection through the init container name", []string{"repair.initContainerName=a' || true || 'b"}, "initContainerName"},
		{"bad digest", []string{"ambientd.image.digest=latest"}, "digest"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := chartrender.Render(chartDir, chartrender.Options{Set: tt.set})
			if err == nil {
				t.Fatalf("--set %v: rendered, want an error naming %q", tt.set, tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("--set %v: error %q does not name %q", tt.set, err, tt.want)
			}
		})
	}
}

// The manifests of deploy/ are the chart's render (cmd/deploy-manifests):
// one source of truth. An edit to either alone fails here.
func TestDeployManifestsAreTheChartsRender(t *testing.T) {
	want, err := chartrender.DeployManifests(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range want {
		got, err := os.ReadFile(filepath.Join(deployDir, name))
		if err != nil {
			t.Errorf("%v (run make deploy-manifests)", err)
			continue
		}
		if !bytes.Equal(got, b) {
			t.Errorf("deploy/%s differs from the chart's render: edit the chart and run make deploy-manifests", name)
		}
	}
	// The sample alerts are one file: deploy/alerts links to the chart's.
	if target, err := os.Readlink(filepath.Join(deployDir, "alerts", "ambientd-alerts.yaml")); err != nil || target != "../helm/ambientd/files/ambientd-alerts.yaml" {
		t.Errorf("deploy/alerts/ambientd-alerts.yaml: link to %q (%v), want the chart's files/ambientd-alerts.yaml", target, err)
	}
}

// `kubectl apply -k deploy/` applies exactly what `helm install` with the
// chart's defaults does on a cluster with the MutatingAdmissionPolicy
// (Kubernetes 1.36+), object for object, field for field; with the
// readiness-gate-webhook component, exactly what it does before 1.36 (the
// webhook instead of the policy).
func TestKustomizationEqualsChartDefaultRender(t *testing.T) {
	deploy, err := filepath.Abs(deployDir)
	if err != nil {
		t.Fatal(err)
	}
	overlay := t.TempDir()
	rel, err := filepath.Rel(overlay, deploy)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte("resources: ["+rel+"]\ncomponents: ["+rel+"/components/readiness-gate-webhook]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ dir, kube string }{{deploy, "v1.37.0"}, {overlay, "v1.33.0"}} {
		t.Run(tc.kube, func(t *testing.T) {
			res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), tc.dir)
			if err != nil {
				t.Fatal(err)
			}
			kust := map[string]map[string]any{}
			for _, r := range res.Resources() {
				m, err := r.Map()
				if err != nil {
					t.Fatal(err)
				}
				// kustomize's built-in schema predates MutatingAdmissionPolicy
				// (GA in 1.36) and flowcontrol v1, and gives them the namespace;
				// the API server drops a namespace on a cluster-scoped kind.
				if k := r.GetKind(); k == "MutatingAdmissionPolicy" || k == "MutatingAdmissionPolicyBinding" || k == "FlowSchema" || k == "PriorityLevelConfiguration" {
					unstructured.RemoveNestedField(m, "metadata", "namespace")
				}
				kust[r.GetKind()+"/"+r.GetName()] = normalize(t, m)
			}
			chart := map[string]map[string]any{}
			for _, o := range render(t, chartrender.Options{Namespace: "istio-system", KubeVersion: tc.kube}) {
				chart[o.GetKind()+"/"+o.GetName()] = normalize(t, o.Object)
			}
			if got, want := keys(kust), keys(chart); !reflect.DeepEqual(got, want) {
				t.Fatalf("kustomize build has %v, the chart's default render %v", got, want)
			}
			for k, want := range chart {
				if got := kust[k]; !reflect.DeepEqual(got, want) {
					g, _ := yaml.Marshal(got)
					w, _ := yaml.Marshal(want)
					t.Errorf("%s: kustomize build:\n%s\nthe chart's default render:\n%s", k, g, w)
				}
			}
		})
	}
}

// The alerts are an option of the chart (the PrometheusRule CRD may be
// missing), rendered into the release's namespace.
func TestAlertsOptional(t *testing.T) {
	for _, o := range render(t, chartrender.Options{}) {
		if o.GetKind() == "PrometheusRule" {
			t.Fatal("PrometheusRule rendered by default")
		}
	}
	var rule *unstructured.Unstructured
	for _, o := range render(t, chartrender.Options{Namespace: "mesh-agents", Set: []string{"ambientd.alerts.enabled=true"}}) {
		if o.GetKind() == "PrometheusRule" {
			rule = o
		}
	}
	if rule == nil || rule.GetNamespace() != "mesh-agents" {
		t.Fatalf("alerts enabled: rule %v, want a PrometheusRule in mesh-agents", rule)
	}
	groups, _, _ := unstructured.NestedSlice(rule.Object, "spec", "groups")
	if len(groups) == 0 {
		t.Error("the PrometheusRule has no groups")
	}
}

func normalize(t *testing.T, m map[string]any) map[string]any {
	t.Helper()
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

func keys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// `helm upgrade` with a value that changes only the ConfigMap (the log
// level, the handover) changes the pod template too, so the DaemonSet
// rolls and the agents read the new settings; the same values leave it as
// it is (no roll for nothing).
func TestConfigChangeRollsTheAgents(t *testing.T) {
	template := func(set ...string) string {
		for _, o := range render(t, chartrender.Options{Set: set}) {
			if o.GetKind() == "DaemonSet" {
				m, _, _ := unstructured.NestedMap(o.Object, "spec", "template")
				b, _ := json.Marshal(m)
				return string(b)
			}
		}
		t.Fatal("no DaemonSet")
		return ""
	}
	base := template("profile=ambient")
	if again := template("profile=ambient"); again != base {
		t.Error("the same values render another pod template")
	}
	for _, set := range []string{"logging.level=debug", "ambientd.handover=istio", "excludeNamespaces={kube-system,monitoring}"} {
		if template("profile=ambient", set) == base {
			t.Errorf("--set %s: the pod template is unchanged, the agents would not roll", set)
		}
	}
}
