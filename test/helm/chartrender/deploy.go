package chartrender

import (
	"fmt"
	"path"
	"strings"
)

// The manifests of deploy/ (the kustomization and its repair components)
// are the chart's render: each file below is one template rendered with the
// values beside it, written by cmd/deploy-manifests and compared byte for
// byte by the chart's tests. The image is left as the bare name `ambientd`
// for the kustomization's images: transformer to set.
var deployFiles = []struct {
	file, template string
	set            []string
}{
	{"rbac.yaml", "templates/rbac.yaml", nil},
	{"admission-policy.yaml", "templates/admission-policy.yaml", nil},
	{"pod-admission.yaml", "templates/pod-admission.yaml", []string{"ambientd.readinessGate.mechanism=policy"}},
	{"configmap.yaml", "templates/configmap.yaml", nil},
	{"daemonset.yaml", "templates/daemonset.yaml", nil},
	{"apf.yaml", "templates/apf.yaml", nil},
	{"components/repair-delete/rbac.yaml", "templates/repair-rbac.yaml", []string{"repair.repairPods=false", "repair.deletePods=true"}},
	{"components/repair-label/rbac.yaml", "templates/repair-rbac.yaml", []string{"repair.repairPods=false", "repair.labelPods=true"}},
	{"components/readiness-gate-webhook/webhook.yaml", "templates/webhook.yaml", []string{"ambientd.readinessGate.mechanism=webhook"}},
}

// DeployManifests renders the chart in chartDir into the files of deploy/,
// by path relative to deploy/.
func DeployManifests(chartDir string) (map[string][]byte, error) {
	out := map[string][]byte{}
	for _, f := range deployFiles {
		set := append([]string{"ambientd.image.repository=ambientd", "ambientd.image.tag="}, f.set...)
		rs, err := Render(chartDir, Options{Namespace: "istio-system", Set: set})
		if err != nil {
			return nil, fmt.Errorf("%s: %w", f.file, err)
		}
		var text string
		for _, r := range rs {
			if r.Template == f.template {
				text = r.Text
			}
		}
		if text == "" {
			return nil, fmt.Errorf("%s: the chart rendered nothing for %s", f.file, f.template)
		}
		header := fmt.Sprintf("# Generated from the Helm chart (deploy/helm/ambientd/%s) by\n# `make deploy-manifests`: edit the chart, then regenerate.\n", f.template)
		out[path.Clean(f.file)] = []byte(header + strings.TrimSpace(text) + "\n")
	}
	return out, nil
}
