package main

import (
	"bytes"
	"fmt"
	"io"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	meshconfig "istio.io/api/mesh/v1alpha1"
	"istio.io/istio/operator/pkg/manifest"
	"istio.io/istio/operator/pkg/render"
	"istio.io/istio/pkg/config/mesh"
	"istio.io/istio/pkg/kube/inject"
)

// injector is what `istioctl kube-inject` uses offline: the injection
// templates and values of the istio-sidecar-injector ConfigMap and the mesh
// config of the istio ConfigMap, here rendered from Istio's embedded charts
// by the same renderer `istioctl install` uses.
type injector struct {
	manifests []manifest.ManifestSet // everything the profile renders

	templates inject.Templates
	values    inject.ValuesConfig
	mesh      *meshconfig.MeshConfig
}

// newInjector renders Istio's charts for the profile and extracts the
// injector's inputs from the generated ConfigMaps.
func newInjector(p profile) (*injector, error) {
	sets := []string{"profile=" + string(p)}
	manifests, _, err := render.GenerateManifest(nil, sets, false, nil, nil)
	if err != nil {
		return nil, fmt.Errorf("render profile %s: %w", p, err)
	}
	inj := &injector{manifests: manifests}
	for _, set := range manifests {
		for _, o := range set.Manifests {
			if o.GetKind() != "ConfigMap" {
				continue
			}
			data, _ := o.Object["data"].(map[string]any)
			switch o.GetName() {
			case "istio-sidecar-injector":
				rawConfig, _ := data["config"].(string)
				rawValues, _ := data["values"].(string)
				cfg, err := inject.UnmarshalConfig([]byte(rawConfig))
				if err != nil {
					return nil, fmt.Errorf("injector config of profile %s: %w", p, err)
				}
				inj.templates = cfg.Templates
				if inj.values, err = inject.NewValuesConfig(rawValues); err != nil {
					return nil, fmt.Errorf("injector values of profile %s: %w", p, err)
				}
			case "istio":
				rawMesh, _ := data["mesh"].(string)
				if inj.mesh, err = mesh.ApplyMeshConfigDefaults(rawMesh); err != nil {
					return nil, fmt.Errorf("mesh config of profile %s: %w", p, err)
				}
			}
		}
	}
	if inj.templates == nil || inj.mesh == nil {
		return nil, fmt.Errorf("profile %s rendered no istio-sidecar-injector or istio ConfigMap", p)
	}
	return inj, nil
}

// inject runs kube-inject's code path (inject.IntoResourceFile) on one pod.
// It returns the injected pod (the input unchanged when Istio skips it) and
// the warnings kube-inject prints.
func (inj *injector) inject(pod *corev1.Pod) (*corev1.Pod, []string, error) {
	in, err := yaml.Marshal(pod)
	if err != nil {
		return nil, nil, err
	}
	var out bytes.Buffer
	var warnings []string
	err = inject.IntoResourceFile(nil, inj.templates, inj.values, "", inj.mesh,
		bytes.NewReader(in), &out, func(w string) { warnings = append(warnings, strings.TrimSpace(w)) })
	if err != nil {
		return nil, warnings, err
	}
	doc := strings.TrimSuffix(strings.TrimSpace(out.String()), "---")
	injected := &corev1.Pod{}
	if err := yaml.UnmarshalStrict([]byte(doc), injected); err != nil {
		return nil, warnings, fmt.Errorf("decode injected pod: %w", err)
	}
	return injected, warnings, nil
}

// writeManifests writes every object the profile renders, one YAML document
// each, grouped by component (what `istioctl manifest generate` prints).
func (inj *injector) writeManifests(w io.Writer) error {
	for _, set := range inj.manifests {
		for _, m := range set.Manifests {
			if _, err := fmt.Fprintf(w, "# component: %s\n%s\n---\n", set.Component, strings.TrimSpace(m.Content)); err != nil {
				return err
			}
		}
	}
	return nil
}
