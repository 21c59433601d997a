// Package chartrender renders Helm charts with Helm's own Go engine, the
// way `helm template` does: chart defaults coalesced with values files and
// --set values, the chart's values.schema.json applied, then the templates.
// It serves the tests of deploy/helm/ambientd and the generator of the
// manifests in deploy/ (cmd/deploy-manifests).
package chartrender

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	chart "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	"helm.sh/helm/v4/pkg/strvals"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// Options say what to render: the release's name and namespace, the
// Kubernetes version the templates see, values files (merged in order) and
// --set style values (applied last).
type Options struct {
	Release     string
	Namespace   string
	KubeVersion string
	ValuesFiles []string
	Set         []string
}

// Rendered is one template's output.
type Rendered struct {
	Template string // path within the chart, e.g. templates/daemonset.yaml
	Text     string
}

// Render renders the chart in dir. An error names what failed: the values
// (schema), a template (its fail message), or a file.
func Render(dir string, o Options) ([]Rendered, error) {
	ch, err := loader.LoadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("load chart %s: %w", dir, err)
	}
	vals, err := Values(o.ValuesFiles, o.Set)
	if err != nil {
		return nil, err
	}
	caps := common.DefaultCapabilities.Copy()
	if o.KubeVersion != "" {
		kv, err := common.ParseKubeVersion(o.KubeVersion)
		if err != nil {
			return nil, fmt.Errorf("kube version %q: %w", o.KubeVersion, err)
		}
		caps.KubeVersion = *kv
	}
	if o.Release == "" {
		o.Release = "ambientd"
	}
	if o.Namespace == "" {
		o.Namespace = "istio-system"
	}
	top, err := util.ToRenderValues(ch, vals, common.ReleaseOptions{Name: o.Release, Namespace: o.Namespace, IsInstall: true}, caps)
	if err != nil {
		return nil, err
	}
	out, err := engine.Render(ch, top)
	if err != nil {
		return nil, err
	}
	return sorted(ch, out), nil
}

// sorted keeps the rendered templates (no helpers, no NOTES), by path.
func sorted(ch *chart.Chart, out map[string]string) []Rendered {
	var rs []Rendered
	prefix := ch.Name() + "/"
	for name, text := range out {
		name = strings.TrimPrefix(name, prefix)
		if !strings.HasSuffix(name, ".yaml") || strings.TrimSpace(text) == "" {
			continue
		}
		rs = append(rs, Rendered{Template: name, Text: text})
	}
	sort.Slice(rs, func(i, j int) bool { return rs[i].Template < rs[j].Template })
	return rs
}

// Values merges values files and --set values as the helm command does.
func Values(files, set []string) (map[string]any, error) {
	base := map[string]any{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		m := map[string]any{}
		if err := yaml.Unmarshal(b, &m); err != nil {
			return nil, fmt.Errorf("values file %s: %w", f, err)
		}
		base = util.MergeTables(m, base)
	}
	for _, s := range set {
		if err := strvals.ParseInto(s, base); err != nil {
			return nil, fmt.Errorf("--set %s: %w", s, err)
		}
	}
	return base, nil
}

// Objects decodes every YAML document of the rendered templates.
func Objects(rs []Rendered) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	for _, r := range rs {
		for _, doc := range splitDocs(r.Text) {
			m := map[string]any{}
			if err := yaml.Unmarshal([]byte(doc), &m); err != nil {
				return nil, fmt.Errorf("%s: %w\n%s", r.Template, err, doc)
			}
			if len(m) == 0 {
				continue
			}
			objs = append(objs, &unstructured.Unstructured{Object: m})
		}
	}
	return objs, nil
}

func splitDocs(s string) []string {
	var docs []string
	var cur strings.Builder
	for _, line := range strings.SplitAfter(s, "\n") {
		if strings.TrimRight(line, "\n") == "---" {
			docs = append(docs, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteString(line)
	}
	return append(docs, cur.String())
}

// IstioModuleDir is the directory of the istio.io/istio module that the
// test-only oracle module (test/istio-oracle) pins, downloaded into the
// module cache if it is not there (`go mod download`: the pin and its
// checksum are that module's go.mod and go.sum). Istio's charts are under
// manifests/charts.
func IstioModuleDir(oracleModule string) (string, error) {
	cmd := exec.Command("go", "mod", "download", "-json", "istio.io/istio")
	cmd.Dir = oracleModule
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go mod download istio.io/istio in %s: %w: %s", oracleModule, err, stderr.String())
	}
	var m struct{ Dir, Error string }
	if err := yaml.Unmarshal(out, &m); err != nil {
		return "", err
	}
	if m.Error != "" || m.Dir == "" {
		return "", fmt.Errorf("go mod download istio.io/istio: %q", m.Error)
	}
	return m.Dir, nil
}

// WriteTo writes the rendered templates as `helm template` prints them.
func WriteTo(w io.Writer, rs []Rendered) error {
	var errs []error
	for _, r := range rs {
		_, err := fmt.Fprintf(w, "---\n# Source: %s\n%s\n", filepath.ToSlash(r.Template), strings.TrimSpace(r.Text))
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}
