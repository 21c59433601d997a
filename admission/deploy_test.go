package admission

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// TestDeployReferencesSurviveOverlays renders deploy/ as shipped and through
// an overlay that renames everything (namePrefix, nameSuffix) and moves it
// to another namespace: the pod admission bindings must still name their
// policies and the agent's ConfigMap where it really is. kustomize does not
// know these references by itself (deploy/kustomizeconfig.yaml teaches it);
// without that, a renamed install would bind nothing — no gate, silently.
func TestDeployReferencesSurviveOverlays(t *testing.T) {
	deploy, err := filepath.Abs("../deploy")
	if err != nil {
		t.Fatal(err)
	}
	overlay := t.TempDir()
	rel, err := filepath.Rel(overlay, deploy)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(
		"namespace: mesh-agent\nnamePrefix: corp-\nnameSuffix: -v2\nresources:\n  - "+rel+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ dir, prefix, suffix, ns string }{
		{deploy, "", "", DefaultAgentNamespace},
		{overlay, "corp-", "-v2", "mesh-agent"},
	} {
		res, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), tc.dir)
		if err != nil {
			t.Fatalf("kustomize %s: %v", tc.dir, err)
		}
		names := map[string]string{} // kind → name (the pod admission objects)
		var cmNamespace, dsName, dsInConfig string
		var dsRights []string
		var mapb, vapb map[string]any
		for _, r := range res.Resources() {
			m, err := r.Map()
			if err != nil {
				t.Fatal(err)
			}
			switch k := r.GetKind(); {
			case k == "ConfigMap":
				names[k], cmNamespace = r.GetName(), r.GetNamespace()
				dsInConfig, _ = m["data"].(map[string]any)["AMBIENTD_DAEMONSET_NAME"].(string)
			case k == "DaemonSet":
				dsName = r.GetName()
			case k == "ClusterRole" && r.GetName() == tc.prefix+"ambientd"+tc.suffix:
				for _, rule := range m["rules"].([]any) {
					rule := rule.(map[string]any)
					if fmt.Sprint(rule["resources"]) == "[daemonsets]" {
						dsRights = append(dsRights, fmt.Sprint(rule["resourceNames"]))
					}
				}
			case r.GetName() == tc.prefix+MutatingPolicyName+tc.suffix && k == "MutatingAdmissionPolicyBinding":
				mapb = m["spec"].(map[string]any)
			case r.GetName() == tc.prefix+ValidatingPolicyName+tc.suffix && k == "ValidatingAdmissionPolicyBinding":
				vapb = m["spec"].(map[string]any)
			case k == "MutatingAdmissionPolicy" || (k == "ValidatingAdmissionPolicy" && r.GetName() == tc.prefix+ValidatingPolicyName+tc.suffix):
				names[k] = r.GetName()
			}
		}
		if mapb == nil || vapb == nil || names["ConfigMap"] != tc.prefix+ConfigMapName+tc.suffix || cmNamespace != tc.ns {
			t.Fatalf("%s: bindings %v %v, ConfigMap %s/%s", tc.dir, mapb, vapb, cmNamespace, names["ConfigMap"])
		}
		ref := mapb["paramRef"].(map[string]any)
		if mapb["policyName"] != names["MutatingAdmissionPolicy"] || ref["name"] != names["ConfigMap"] || ref["namespace"] != cmNamespace {
			t.Errorf("%s: MutatingAdmissionPolicyBinding %v; policy %s, ConfigMap %s/%s", tc.dir, mapb, names["MutatingAdmissionPolicy"], cmNamespace, names["ConfigMap"])
		}
		if vapb["policyName"] != names["ValidatingAdmissionPolicy"] {
			t.Errorf("%s: ValidatingAdmissionPolicyBinding %v; policy %s", tc.dir, vapb, names["ValidatingAdmissionPolicy"])
		}
		// The agent reads its DaemonSet by the ConfigMap's name, and may
		// read only that one: both follow a rename.
		if want := "[" + dsName + "]"; dsName != tc.prefix+"ambientd"+tc.suffix || dsInConfig != dsName || len(dsRights) != 1 || dsRights[0] != want {
			t.Errorf("%s: DaemonSet %q, ConfigMap's AMBIENTD_DAEMONSET_NAME %q, the agent may get daemonsets %v: want all the DaemonSet's name", tc.dir, dsName, dsInConfig, dsRights)
		}
	}
}
