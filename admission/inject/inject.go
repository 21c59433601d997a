// Package inject is `ambientd inject`: the readiness-gate injection of the
// shipped MutatingAdmissionPolicy (deploy/pod-admission.yaml), done to
// manifests before they reach a cluster — for clusters older than
// Kubernetes 1.36 (no MutatingAdmissionPolicy) and for pipelines that render
// manifests (GitOps). The decision is admission.Settings.Decide, the same
// the policy's case table holds it to.
//
// Input is a stream of YAML documents or JSON values (Pod, Deployment,
// StatefulSet, DaemonSet, ReplicaSet, ReplicationController, Job, CronJob,
// and List of them; Namespace documents supply their labels; anything else
// passes through). Only the pod templates that get the gate change; every
// other byte of the input is written back as it was (document separators
// and comments included), and a changed YAML document keeps its comments
// and key order. Injecting twice changes nothing the second time.
package inject

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/kustomize/kyaml/yaml"

	"github.com/ambientd/ambientd/admission"
)

// Options configure Inject.
type Options struct {
	Settings admission.Settings
	// Namespace is the namespace of documents that name none (-n; empty:
	// "default", as kubectl without a context namespace).
	Namespace string
	// NamespaceLabels knows the labels of namespaces the input does not
	// define (a Namespace document in the input wins). ok=false: unknown.
	NamespaceLabels func(name string) (labels map[string]string, ok bool)
	// Warn receives what the user should know (a namespace whose labels
	// are unknown, so a workload there is judged by its own labels only).
	Warn func(msg string)
}

// Template is one pod (template) of the input and what inject did with it.
type Template struct {
	Kind, Namespace, Name string
	Decision              admission.Decision
}

// Result says what Inject saw.
type Result struct {
	Templates []Template
}

// Injected counts the templates that got the gate.
func (r Result) Injected() int {
	n := 0
	for _, t := range r.Templates {
		if t.Decision.AddGate {
			n++
		}
	}
	return n
}

// templatePath says where each workload kind keeps its pod template (nil
// for a Pod: the document is the pod).
var templatePath = map[string][]string{
	"Pod":                   nil,
	"Deployment":            {"spec", "template"},
	"StatefulSet":           {"spec", "template"},
	"DaemonSet":             {"spec", "template"},
	"ReplicaSet":            {"spec", "template"},
	"ReplicationController": {"spec", "template"},
	"Job":                   {"spec", "template"},
	"CronJob":               {"spec", "jobTemplate", "spec", "template"},
}

// Inject reads manifests from r and writes them to w with the readiness gate
// added to the pod templates the mesh will enroll. The input is read whole
// first (a Namespace document may follow the workloads in it).
func Inject(r io.Reader, w io.Writer, opts Options) (Result, error) {
	in, err := io.ReadAll(r)
	if err != nil {
		return Result{}, fmt.Errorf("read manifests: %w", err)
	}
	if opts.Namespace == "" {
		opts.Namespace = "default"
	}
	if opts.Warn == nil {
		opts.Warn = func(string) {}
	}
	var docs []*document
	if t := bytes.TrimSpace(in); len(t) > 0 && (t[0] == '{' || t[0] == '[') {
		docs, err = splitJSON(in)
	} else {
		docs, err = splitYAML(in)
	}
	if err != nil {
		return Result{}, err
	}
	inj := &injector{opts: opts, nsLabels: map[string]map[string]string{}, warned: map[string]bool{}}
	for _, d := range docs {
		if d.node != nil {
			inj.collectNamespaces(d.node)
		}
	}
	for i, d := range docs {
		if d.node == nil {
			continue
		}
		changed, err := inj.visit(d.node)
		if err != nil {
			return Result{}, fmt.Errorf("document %d: %w", i+1, err)
		}
		if changed {
			if d.text, err = d.render(d.node); err != nil {
				return Result{}, fmt.Errorf("document %d: %w", i+1, err)
			}
		}
	}
	for _, d := range docs {
		if _, err := io.WriteString(w, d.text); err != nil {
			return Result{}, err
		}
	}
	return Result{Templates: inj.templates}, nil
}

type injector struct {
	opts      Options
	nsLabels  map[string]map[string]string // from Namespace documents
	warned    map[string]bool
	templates []Template
}

// items returns the objects of node: its items when it is a List, else
// node itself.
func items(node *yaml.RNode) []*yaml.RNode {
	if node.GetKind() != "List" && !strings.HasSuffix(node.GetKind(), "List") {
		return []*yaml.RNode{node}
	}
	list, err := node.Pipe(yaml.Lookup("items"))
	if err != nil || list == nil {
		return nil
	}
	els, _ := list.Elements()
	return els
}

func (inj *injector) collectNamespaces(node *yaml.RNode) {
	for _, o := range items(node) {
		if o.GetKind() == "Namespace" && o.GetName() != "" {
			inj.nsLabels[o.GetName()] = o.GetLabels()
		}
	}
}

func (inj *injector) labelsOf(ns string) (map[string]string, bool) {
	if l, ok := inj.nsLabels[ns]; ok {
		return l, true
	}
	if inj.opts.NamespaceLabels != nil {
		return inj.opts.NamespaceLabels(ns)
	}
	return nil, false
}

// visit injects into every pod template of node; it reports whether node
// changed.
func (inj *injector) visit(node *yaml.RNode) (bool, error) {
	changed := false
	for _, o := range items(node) {
		path, ok := templatePath[o.GetKind()]
		if !ok {
			continue
		}
		c, err := inj.inject(o, path)
		if err != nil {
			return false, fmt.Errorf("%s %s: %w", o.GetKind(), o.GetName(), err)
		}
		changed = changed || c
	}
	return changed, nil
}

func (inj *injector) inject(obj *yaml.RNode, path []string) (bool, error) {
	tmpl := obj
	if len(path) > 0 {
		var err error
		if tmpl, err = obj.Pipe(yaml.Lookup(path...)); err != nil || tmpl == nil {
			return false, nil // no template (yet): nothing to inject into
		}
	}
	raw, err := tmpl.MarshalJSON()
	if err != nil {
		return false, err
	}
	var pod corev1.Pod
	if err := json.Unmarshal(raw, &pod); err != nil {
		return false, fmt.Errorf("pod template: %w", err)
	}
	ns := obj.GetNamespace()
	if ns == "" {
		ns = inj.opts.Namespace
	}
	pod.Namespace = ns
	labels, known := inj.labelsOf(ns)
	d := inj.opts.Settings.Decide(&pod, labels)
	inj.templates = append(inj.templates, Template{Kind: obj.GetKind(), Namespace: ns, Name: obj.GetName(), Decision: d})
	if !known && !d.Policy.InMesh && !inj.warned[ns] && pod.Labels[admission.LabelReadinessGate] != admission.OptOutValue {
		inj.warned[ns] = true
		inj.opts.Warn(fmt.Sprintf("namespace %s: labels unknown (no Namespace document in the input, none given with --ambient-namespaces, none in the cluster): its workloads are judged by their own labels only", ns))
	}
	if !d.AddGate {
		return false, nil
	}
	spec, err := tmpl.Pipe(yaml.LookupCreate(yaml.MappingNode, "spec"))
	if err != nil {
		return false, err
	}
	gate := yaml.NewMapRNode(&map[string]string{"conditionType": inj.opts.Settings.ConditionType})
	gates := spec.Field("readinessGates")
	if gates == nil || yaml.IsMissingOrNull(gates.Value) || gates.Value.YNode().Kind != yaml.SequenceNode {
		list := yaml.NewListRNode()
		list.YNode().Content = []*yaml.Node{gate.YNode()}
		return true, spec.PipeE(yaml.SetField("readinessGates", list))
	}
	_, err = gates.Value.Pipe(yaml.Append(gate.YNode()))
	return true, err
}

// Kinds lists the workload kinds whose pod templates inject handles.
func Kinds() []string {
	var out []string
	for k := range templatePath {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
