package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	flowcontrolv1 "k8s.io/api/flowcontrol/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// apfLevel is the agents' priority level in deploy/apf.yaml.
const apfLevel = "ambientd"

// applyAPF creates the shipped FlowSchema and PriorityLevelConfiguration
// (deploy/apf.yaml, as the chart renders them) on the apiserver, so the
// agents' requests are classified and queued as in a cluster that
// installed the chart. It returns their names.
func applyAPF(ctx context.Context, client kubernetes.Interface) ([]string, error) {
	root, err := e2eenv.RepoRoot()
	if err != nil {
		return nil, err
	}
	path := filepath.Join(root, "deploy", "apf.yaml")
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the shipped APF objects: %w", err)
	}
	fc := client.FlowcontrolV1()
	var applied []string
	docs := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(string(b))))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return applied, fmt.Errorf("%s: %w", path, err)
		}
		var meta metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			return applied, fmt.Errorf("%s: %w", path, err)
		}
		switch meta.Kind {
		case "PriorityLevelConfiguration":
			var o flowcontrolv1.PriorityLevelConfiguration
			if err := yaml.UnmarshalStrict(doc, &o); err != nil {
				return applied, fmt.Errorf("%s: %s: %w", path, meta.Kind, err)
			}
			_, err = fc.PriorityLevelConfigurations().Create(ctx, &o, metav1.CreateOptions{})
			applied = append(applied, meta.Kind+"/"+o.Name)
		case "FlowSchema":
			var o flowcontrolv1.FlowSchema
			if err := yaml.UnmarshalStrict(doc, &o); err != nil {
				return applied, fmt.Errorf("%s: %s: %w", path, meta.Kind, err)
			}
			_, err = fc.FlowSchemas().Create(ctx, &o, metav1.CreateOptions{})
			applied = append(applied, meta.Kind+"/"+o.Name)
		case "":
			continue // a document of comments only
		default:
			return applied, fmt.Errorf("%s: unexpected kind %q", path, meta.Kind)
		}
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return applied, fmt.Errorf("create %s: %w", applied[len(applied)-1], err)
		}
	}
	if len(applied) != 2 {
		return applied, fmt.Errorf("%s holds %v, want a PriorityLevelConfiguration and a FlowSchema", path, applied)
	}
	return applied, nil
}
