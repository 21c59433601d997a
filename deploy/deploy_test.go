// Package deploy holds no code: its tests check that the manifests beside
// them agree with the agent and with docs/security.md (the API server's
// view of them is in test/e2e).
package deploy

import (
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/resmap"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/nodeagent/agent"
	"github.com/ambientd/ambientd/nodeagent/nodeready"
	"github.com/ambientd/ambientd/podmeta"
)

// render kustomizes dir.
func render(t *testing.T, dir string) resmap.ResMap {
	t.Helper()
	res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize %s: %v", dir, err)
	}
	return res
}

// object decodes the one resource of kind (and name, if given) in res.
func object(t *testing.T, res resmap.ResMap, kind, name string, into any) {
	t.Helper()
	for _, r := range res.Resources() {
		if r.GetKind() != kind || (name != "" && r.GetName() != name) {
			continue
		}
		b, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.UnmarshalStrict(b, into); err != nil {
			t.Fatalf("%s %s: %v", kind, r.GetName(), err)
		}
		return
	}
	t.Fatalf("no %s %q in the rendered manifests", kind, name)
}

// docTable returns the rows (cells trimmed) of the first Markdown table after
// the heading in docs/security.md, header and separator dropped.
func docTable(t *testing.T, heading string) [][]string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", "security.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(b), "\n"+heading+"\n")
	if !ok {
		t.Fatalf("docs/security.md has no heading %q", heading)
	}
	var rows [][]string
	for _, line := range strings.Split(after, "\n") {
		if !strings.HasPrefix(line, "|") {
			if len(rows) > 0 {
				break
			}
			continue
		}
		var cells []string
		for _, c := range strings.Split(strings.Trim(line, "|"), "|") {
			cells = append(cells, strings.TrimSpace(c))
		}
		rows = append(rows, cells)
	}
	if len(rows) < 3 {
		t.Fatalf("docs/security.md %q: no table", heading)
	}
	return rows[2:]
}

// The rights table of docs/security.md lists exactly the rules of the
// agent's ClusterRole: each rule one row of group, resources and verbs.
func TestSecurityDocListsEveryRBACRule(t *testing.T) {
	var role rbacv1.ClusterRole
	object(t, render(t, "."), "ClusterRole", "ambientd", &role)
	var want []string
	for _, r := range role.Rules {
		if len(r.APIGroups) != 1 || len(r.NonResourceURLs) != 0 {
			t.Errorf("rule %+v: one API group per rule, no URLs (the table has one row per rule)", r)
			continue
		}
		group := r.APIGroups[0]
		if group == "" {
			group = "core"
		}
		var res, names []string
		for _, x := range r.Resources {
			res = append(res, "`"+x+"`")
		}
		for _, x := range r.ResourceNames {
			names = append(names, "`"+x+"`")
		}
		cell := strings.Join(res, ", ")
		if len(names) > 0 {
			cell += " named " + strings.Join(names, ", ") // rights narrowed to these objects
		}
		want = append(want, group+" | "+cell+" | "+strings.Join(r.Verbs, ", "))
	}
	var got []string
	for _, row := range docTable(t, "## Rights (RBAC)") {
		if len(row) != 4 || row[3] == "" {
			t.Errorf("docs/security.md rights row %q: want group | resources | verbs | what for", row)
			continue
		}
		got = append(got, strings.Join(row[:3], " | "))
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("docs/security.md's rights table does not match deploy/rbac.yaml:\ndocumented:\n  %s\nrbac.yaml:\n  %s",
			strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
}

// policyVariables returns the policy's variables by name (expressions).
func policyVariables(t *testing.T, res resmap.ResMap) map[string]string {
	t.Helper()
	var p admissionv1.ValidatingAdmissionPolicy
	object(t, res, "ValidatingAdmissionPolicy", "", &p)
	vars := map[string]string{}
	for _, v := range p.Spec.Variables {
		vars[v.Name] = v.Expression
	}
	return vars
}

// What the policy lets the agent write is what the agent writes: the
// policy's literals, the ConfigMap the agent reads and the agent's defaults
// name the same taint key, condition types, annotation and values.
func TestPolicyOwnsWhatTheAgentWrites(t *testing.T) {
	res := render(t, ".")
	vars := policyVariables(t, res)
	var cm corev1.ConfigMap
	object(t, res, "ConfigMap", "ambientd-config", &cm)
	for _, c := range []struct{ variable, env, def string }{
		{"taintKey", "AMBIENTD_TAINT_KEY", nodeready.DefaultTaintKey},
		{"nodeCondition", "AMBIENTD_NODE_CONDITION_TYPE", nodeready.DefaultConditionType},
		{"podCondition", "AMBIENTD_POD_CONDITION_TYPE", podmeta.ConditionEnrolled},
		{"annotation", "", podmeta.AnnotationRedirection},
	} {
		if got, want := vars[c.variable], "'"+c.def+"'"; got != want {
			t.Errorf("policy variable %s = %s, want %s (the agent's default)", c.variable, got, want)
		}
		if c.env != "" && cm.Data[c.env] != c.def {
			t.Errorf("ConfigMap %s = %q, want %q (what the policy allows)", c.env, cm.Data[c.env], c.def)
		}
	}
	raw, err := os.ReadFile("admission-policy.yaml")
	if err != nil {
		t.Fatal(err)
	}
	values := "['" + podmeta.RedirectionEnabled + "', '" + podmeta.RedirectionPending + "']"
	if !strings.Contains(string(raw), "variables.newAnnotations[variables.annotation] in "+values) {
		t.Errorf("admission-policy.yaml does not limit the annotation's values to %s", values)
	}
}

// `kubectl delete -k deploy/` deletes what the kustomization holds: a
// Namespace there would take istio-system, and Istio, with it.
func TestKustomizationHoldsNoNamespace(t *testing.T) {
	for _, r := range render(t, ".").Resources() {
		if r.GetKind() == "Namespace" {
			t.Errorf("the kustomization holds Namespace %s: uninstalling would delete it", r.GetName())
		}
	}
}

// The overlay docs/security.md shows for another taint key changes it in
// the ConfigMap and in the policy alike.
func TestTaintKeyOverlayExample(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "docs", "security.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)```yaml\n(# kustomization.yaml of your overlay\n.*?)```").FindSubmatch(b)
	if m == nil {
		t.Fatal("docs/security.md: no overlay example")
	}
	abs, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	base, err := filepath.Rel(dir, abs)
	if err != nil {
		t.Fatal(err)
	}
	k := strings.Replace(string(m[1]), "resources: [../deploy]", "resources: ["+base+"]", 1)
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	res := render(t, dir)
	const key = "ambientd.io/mesh-not-ready"
	if got := policyVariables(t, res)["taintKey"]; got != "'"+key+"'" {
		t.Errorf("overlay: policy taintKey = %s, want '%s'", got, key)
	}
	var cm corev1.ConfigMap
	object(t, res, "ConfigMap", "ambientd-config", &cm)
	if cm.Data["AMBIENTD_TAINT_KEY"] != key {
		t.Errorf("overlay: ConfigMap AMBIENTD_TAINT_KEY = %q, want %q", cm.Data["AMBIENTD_TAINT_KEY"], key)
	}
}

// The components' rights table of docs/security.md lists exactly the rules
// of the opt-in repair components' roles, and each component binds its role
// to the agent's ServiceAccount and sets the repair mode.
func TestSecurityDocListsRepairComponentRights(t *testing.T) {
	var want []string
	for _, comp := range []string{"repair-delete", "repair-label"} {
		dir := t.TempDir()
		abs, err := filepath.Abs(".")
		if err != nil {
			t.Fatal(err)
		}
		base, err := filepath.Rel(dir, abs)
		if err != nil {
			t.Fatal(err)
		}
		k := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [" + base + "]\ncomponents: [" + filepath.Join(base, "components", comp) + "]\n"
		if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(k), 0o644); err != nil {
			t.Fatal(err)
		}
		res := render(t, dir)
		var role rbacv1.ClusterRole
		object(t, res, "ClusterRole", "ambientd-"+comp, &role)
		for _, r := range role.Rules {
			group := r.APIGroups[0]
			if group == "" {
				group = "core"
			}
			var rs []string
			for _, x := range r.Resources {
				rs = append(rs, "`"+x+"`")
			}
			want = append(want, comp+" | "+group+" | "+strings.Join(rs, ", ")+" | "+strings.Join(r.Verbs, ", "))
		}
		var binding rbacv1.ClusterRoleBinding
		object(t, res, "ClusterRoleBinding", "ambientd-"+comp, &binding)
		var sa corev1.ServiceAccount
		object(t, res, "ServiceAccount", "", &sa)
		if len(binding.Subjects) != 1 || binding.Subjects[0].Name != sa.Name || binding.Subjects[0].Namespace != sa.Namespace {
			t.Errorf("%s: binding subjects %+v, want the agent's ServiceAccount %s/%s", comp, binding.Subjects, sa.Namespace, sa.Name)
		}
		var cm corev1.ConfigMap
		object(t, res, "ConfigMap", "ambientd-config", &cm)
		if mode := strings.TrimPrefix(comp, "repair-"); cm.Data["AMBIENTD_REPAIR_MODE"] != mode {
			t.Errorf("%s: AMBIENTD_REPAIR_MODE = %q, want %q", comp, cm.Data["AMBIENTD_REPAIR_MODE"], mode)
		}
	}
	var got []string
	for _, row := range docTable(t, "## Rights of the opt-in repair components") {
		if len(row) != 5 || row[4] == "" {
			t.Errorf("row %q: want component | group | resources | verbs | what for", row)
			continue
		}
		got = append(got, strings.Join(row[:4], " | "))
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("docs/security.md's components table does not match the components:\ndocumented:\n  %s\ncomponents:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	// The base ConfigMap repairs (the mode that needs no extra right).
	var cm corev1.ConfigMap
	object(t, render(t, "."), "ConfigMap", "ambientd-config", &cm)
	if cm.Data["AMBIENTD_REPAIR_MODE"] != "repair" {
		t.Errorf("base AMBIENTD_REPAIR_MODE = %q, want repair", cm.Data["AMBIENTD_REPAIR_MODE"])
	}
}

// The DaemonSet serves and mounts what the ConfigMap tells the agent: its
// ports are the health and metrics addresses' (probes included), every
// directory the agent uses is mounted (the sockets and the run dir from
// the host at the same path: the plugin and ztunnel find them there), and
// the DaemonSet is the one the installer's shutdown rule reads.
func TestDaemonSetMatchesConfigMap(t *testing.T) {
	res := render(t, ".")
	var cm corev1.ConfigMap
	object(t, res, "ConfigMap", "ambientd-config", &cm)
	var ds appsv1.DaemonSet
	object(t, res, "DaemonSet", "ambientd", &ds)
	c := ds.Spec.Template.Spec.Containers[0]
	port := func(env string) int32 {
		_, p, err := net.SplitHostPort(cm.Data[env])
		if err != nil {
			t.Fatalf("ConfigMap %s = %q: %v", env, cm.Data[env], err)
		}
		n, err := strconv.Atoi(p)
		if err != nil {
			t.Fatal(err)
		}
		return int32(n)
	}
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if want := port("AMBIENTD_HEALTH_ADDR"); ports["health"] != want {
		t.Errorf("container port health %d, ConfigMap's health address port %d", ports["health"], want)
	}
	if want := port("AMBIENTD_METRICS_ADDR"); ports["metrics"] != want {
		t.Errorf("container port metrics %d, ConfigMap's metrics address port %d", ports["metrics"], want)
	}
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Port.IntValue() != int(port("AMBIENTD_HEALTH_ADDR")) {
			t.Errorf("%s probe %+v: want an HTTP GET on the health port", name, p)
		}
	}
	hostPaths := map[string]string{}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			hostPaths[v.Name] = v.HostPath.Path
		}
	}
	mounted := func(dir string) (hostPath string, ok bool) {
		for _, m := range c.VolumeMounts {
			if m.MountPath == dir {
				return hostPaths[m.Name], true
			}
		}
		return "", false
	}
	for _, d := range []struct{ what, dir string }{
		{"ztunnel socket's dir", filepath.Dir(cm.Data["ZTUNNEL_UDS_ADDRESS"])},
		{"CNI socket's dir", filepath.Dir(cm.Data["AMBIENTD_CNI_SOCKET"])},
		{"run dir (state file, admin socket)", agent.DefaultConfig().RunDir},
	} {
		if hp, ok := mounted(d.dir); !ok || hp != d.dir {
			t.Errorf("%s %s: mounted from host path %q (mounted: %v), want the same path on the host", d.what, d.dir, hp, ok)
		}
	}
	for _, env := range []string{"AMBIENTD_CNI_BIN_DIR", "AMBIENTD_CNI_CONF_DIR", "AMBIENTD_HOST_PROC"} {
		if _, ok := mounted(cm.Data[env]); !ok {
			t.Errorf("ConfigMap %s = %s: not mounted", env, cm.Data[env])
		}
	}
	if cm.Data["AMBIENTD_DAEMONSET_NAME"] != ds.Name {
		t.Errorf("ConfigMap AMBIENTD_DAEMONSET_NAME %q, the DaemonSet is %q", cm.Data["AMBIENTD_DAEMONSET_NAME"], ds.Name)
	}
	if cm.Data["AMBIENTD_SYSTEM_NAMESPACE"] != ds.Namespace {
		t.Errorf("ConfigMap AMBIENTD_SYSTEM_NAMESPACE %q, the DaemonSet runs in %q", cm.Data["AMBIENTD_SYSTEM_NAMESPACE"], ds.Namespace)
	}
}
