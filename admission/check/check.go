// Package check is `ambientd check` (the check-inject of this project): for
// existing pods, or the pod templates of a manifest, it says whether each pod
// is (or will be) in the ambient mesh and gated on ambient.istio.io/enrolled,
// which label or annotation decided it, and — for existing pods — the node,
// the agent's annotation and condition, and whether an agent serves that
// node. It needs only a kubeconfig (reads through the API; no node access),
// and degrades to notes where the user may not read something.
package check

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/nodeagent/kube"
	"github.com/ambientd/ambientd/nodeagent/podopts"
	"github.com/ambientd/ambientd/podmeta"
)

// Options configure a Checker.
type Options struct {
	// AgentNamespace holds the agent's ConfigMap and DaemonSet pods
	// (default istio-system).
	AgentNamespace string
	// AgentSelector selects the agent's DaemonSet pods (default
	// app=ambientd).
	AgentSelector string
	// NodeConditionType is the agent's node condition (default
	// ambient.istio.io/NodeReady).
	NodeConditionType string
}

// Defaults of Options.
const (
	DefaultAgentSelector     = "app=ambientd"
	DefaultNodeConditionType = "ambient.istio.io/NodeReady"
)

// Report is what check found; it is the -o json output.
type Report struct {
	Settings  SettingsInfo  `json:"settings"`
	Admission AdmissionInfo `json:"admission"`
	Pods      []Pod         `json:"pods"`
	Notes     []string      `json:"notes,omitempty"`
}

// SettingsInfo says which agent settings decided, and where they came from.
type SettingsInfo struct {
	Source            string   `json:"source"`
	ExcludeNamespaces []string `json:"excludeNamespaces"`
	SystemNamespace   string   `json:"systemNamespace"`
	ConditionType     string   `json:"conditionType"`
}

// AdmissionInfo says whether the shipped pod admission policies are
// installed.
type AdmissionInfo struct {
	GatePolicy       bool `json:"gatePolicy"`
	AnnotationPolicy bool `json:"annotationPolicy"`
	// GateWebhook: the readiness-gate webhook's configuration
	// (`ambientd webhook`, clusters before 1.36) is installed.
	GateWebhook bool `json:"gateWebhook"`
	// Known is false when the user may not list admission policies.
	Known bool `json:"known"`
}

// Pod is one pod, or one pod template of a manifest.
type Pod struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// Kind is Pod for an existing pod, else the manifest's kind.
	Kind string `json:"kind"`
	// Enrolled is policy's verdict; Reason its fixed reason;
	// DecidedBy says in words which label, annotation or setting decided.
	Enrolled  bool   `json:"enrolled"`
	Reason    string `json:"reason"`
	DecidedBy string `json:"decidedBy"`
	// Gated: the pod names the condition in spec.readinessGates (existing
	// pods), or will when created (manifests). Gate says why (not).
	Gated bool   `json:"gated"`
	Gate  string `json:"gate"`
	// AnnotationError is the agent's refusal of the pod's mesh
	// annotations, if any.
	AnnotationError string `json:"annotationError,omitempty"`

	// Existing pods only.
	Node        string     `json:"node,omitempty"`
	Phase       string     `json:"phase,omitempty"`
	Ready       bool       `json:"ready"`
	Redirection string     `json:"redirection,omitempty"`
	Condition   *Condition `json:"condition,omitempty"`
	Agent       *Agent     `json:"agent,omitempty"`

	// Verdict is the one-line summary; Attention marks a pod the user
	// should look at (not meshed while it should be, stuck, unprotected).
	Verdict   string `json:"verdict"`
	Attention bool   `json:"attention"`
}

// Condition is the agent's pod condition as the pod shows it.
type Condition struct {
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message,omitempty"`
}

// Agent says whether an agent serves a pod's node.
type Agent struct {
	// Serves: an agent pod runs on the node.
	Serves bool   `json:"serves"`
	Pod    string `json:"pod,omitempty"`
	Ready  bool   `json:"ready"`
	// NodeCondition is the node's ambient.istio.io/NodeReady as
	// "status/reason" ("" when absent or unreadable).
	NodeCondition string `json:"nodeCondition,omitempty"`
}

// Checker answers check questions against one cluster.
type Checker struct {
	client   kube.Interface
	opts     Options
	settings admission.Settings
	report   Report // the common part: settings, admission, notes
	nsCache  map[string]map[string]string
	agents   map[string]*corev1.Pod // node → agent pod
	agentsOK bool
}

// New reads the agent's settings (its ConfigMap; the agent's defaults, with
// a note, when it cannot be read) and whether the admission policies are
// installed.
func New(ctx context.Context, client kube.Interface, opts Options) *Checker {
	if opts.AgentNamespace == "" {
		opts.AgentNamespace = admission.DefaultAgentNamespace
	}
	if opts.AgentSelector == "" {
		opts.AgentSelector = DefaultAgentSelector
	}
	if opts.NodeConditionType == "" {
		opts.NodeConditionType = DefaultNodeConditionType
	}
	c := &Checker{client: client, opts: opts, nsCache: map[string]map[string]string{}}
	c.settings = admission.DefaultSettings()
	src := "ConfigMap " + opts.AgentNamespace + "/" + admission.ConfigMapName
	cm, err := client.CoreV1().ConfigMaps(opts.AgentNamespace).Get(ctx, admission.ConfigMapName, metav1.GetOptions{})
	if err == nil {
		c.settings = admission.SettingsFrom(cm.Data)
	} else {
		src = "the agent's defaults"
		c.note("cannot read ConfigMap %s/%s (%s): using the agent's defaults", opts.AgentNamespace, admission.ConfigMapName, short(err))
	}
	c.report.Settings = SettingsInfo{
		Source: src, ExcludeNamespaces: c.settings.Policy.ExcludeNamespaces,
		SystemNamespace: c.settings.Policy.SystemNamespace, ConditionType: c.settings.ConditionType,
	}
	c.report.Admission = c.admissionInfo(ctx)
	return c
}

// Settings are the agent settings the checker decides with.
func (c *Checker) Settings() admission.Settings { return c.settings }

// Override replaces the settings (flags given on the command line win over
// the cluster's ConfigMap); the report says so when they differ.
func (c *Checker) Override(s admission.Settings) {
	if !slices.Equal(s.Policy.ExcludeNamespaces, c.settings.Policy.ExcludeNamespaces) ||
		s.Policy.SystemNamespace != c.settings.Policy.SystemNamespace || s.ConditionType != c.settings.ConditionType {
		c.report.Settings.Source += ", overridden by flags"
	}
	c.settings = s
	c.report.Settings.ExcludeNamespaces = s.Policy.ExcludeNamespaces
	c.report.Settings.SystemNamespace = s.Policy.SystemNamespace
	c.report.Settings.ConditionType = s.ConditionType
}

// NamespaceLabels returns the labels of namespace ns as the cluster has
// them; ok=false when it does not exist or cannot be read.
func (c *Checker) NamespaceLabels(ctx context.Context, ns string) (map[string]string, bool) {
	return c.namespaceLabels(ctx, ns)
}

func (c *Checker) note(format string, args ...any) {
	c.report.Notes = append(c.report.Notes, fmt.Sprintf(format, args...))
}

// short is an API error without the request details.
func short(err error) string {
	var se *apierrors.StatusError
	if errors.As(err, &se) {
		return string(se.ErrStatus.Reason)
	}
	return err.Error()
}

func (c *Checker) admissionInfo(ctx context.Context) AdmissionInfo {
	a := AdmissionInfo{Known: true}
	arv1 := c.client.AdmissionregistrationV1()
	// Bindings make policies act: look for a binding of each policy.
	maps, err := arv1.MutatingAdmissionPolicyBindings().List(ctx, metav1.ListOptions{})
	switch {
	case apierrors.IsNotFound(err):
		// The API has no MutatingAdmissionPolicy (before 1.36): none.
	case err != nil:
		a.Known = false
		c.note("cannot list MutatingAdmissionPolicyBindings (%s): whether admission adds the gate is unknown", short(err))
	default:
		for _, b := range maps.Items {
			if _, err := arv1.MutatingAdmissionPolicies().Get(ctx, b.Spec.PolicyName, metav1.GetOptions{}); err == nil && strings.Contains(b.Spec.PolicyName, admission.MutatingPolicyName) {
				a.GatePolicy = true
			}
		}
	}
	switch cfg, err := arv1.MutatingWebhookConfigurations().Get(ctx, admission.MutatingPolicyName, metav1.GetOptions{}); {
	case err == nil:
		a.GateWebhook = slices.ContainsFunc(cfg.Webhooks, func(w admissionregistrationv1.MutatingWebhook) bool { return w.Name == admission.WebhookName })
	case !apierrors.IsNotFound(err):
		a.Known = false
		c.note("cannot read MutatingWebhookConfiguration %s (%s): whether admission adds the gate is unknown", admission.MutatingPolicyName, short(err))
	}
	vaps, err := arv1.ValidatingAdmissionPolicyBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		a.Known = false
	} else {
		for _, b := range vaps.Items {
			if _, err := arv1.ValidatingAdmissionPolicies().Get(ctx, b.Spec.PolicyName, metav1.GetOptions{}); err == nil && strings.Contains(b.Spec.PolicyName, admission.ValidatingPolicyName) {
				a.AnnotationPolicy = true
			}
		}
	}
	if a.Known && !a.GatePolicy && !a.GateWebhook {
		c.note("neither the admission policy nor the webhook %s is installed: new pods get no readiness gate (the chart, or kubectl apply -k deploy/ with the readiness-gate-webhook component before Kubernetes 1.36, or ambientd inject)", admission.MutatingPolicyName)
	}
	return a
}

// namespaceLabels returns the labels of namespace ns (cached); ok=false
// when it cannot be read.
func (c *Checker) namespaceLabels(ctx context.Context, ns string) (map[string]string, bool) {
	if l, ok := c.nsCache[ns]; ok {
		return l, l != nil
	}
	n, err := c.client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{})
	if err != nil {
		c.nsCache[ns] = nil
		if !apierrors.IsNotFound(err) {
			c.note("cannot read namespace %s (%s): its labels are unknown", ns, short(err))
		}
		return nil, false
	}
	l := n.Labels
	if l == nil {
		l = map[string]string{}
	}
	c.nsCache[ns] = l
	return l, true
}

// Pods checks existing pods: those named in namespace ns, or every pod of
// ns when names is empty (every namespace when ns is empty too).
func (c *Checker) Pods(ctx context.Context, ns string, names []string) (Report, error) {
	var pods []corev1.Pod
	if len(names) == 0 {
		list, err := c.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return Report{}, fmt.Errorf("list pods: %w", err)
		}
		pods = list.Items
	} else {
		for _, n := range names {
			p, err := c.client.CoreV1().Pods(ns).Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return Report{}, fmt.Errorf("pod %s/%s: %w", ns, n, err)
			}
			pods = append(pods, *p)
		}
	}
	slices.SortFunc(pods, func(a, b corev1.Pod) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	r := c.report
	r.Pods = []Pod{}
	for i := range pods {
		r.Pods = append(r.Pods, c.pod(ctx, &pods[i]))
	}
	r.Notes = slices.Clone(c.report.Notes)
	return r, nil
}

func (c *Checker) pod(ctx context.Context, p *corev1.Pod) Pod {
	nsLabels, _ := c.namespaceLabels(ctx, p.Namespace)
	d := c.settings.Decide(p, nsLabels)
	out := Pod{
		Namespace: p.Namespace, Name: p.Name, Kind: "Pod",
		Enrolled: d.Policy.InMesh, Reason: string(d.Policy.Reason), DecidedBy: c.decidedBy(p, d.Policy),
		Gated: d.HasGate, Node: p.Spec.NodeName, Phase: string(p.Status.Phase),
		Redirection: p.Annotations[podmeta.AnnotationRedirection],
	}
	if _, err := podopts.PodOptions(true, p.Annotations); err != nil {
		out.AnnotationError = err.Error()
	}
	for _, cond := range p.Status.Conditions {
		switch string(cond.Type) {
		case string(corev1.PodReady):
			out.Ready = cond.Status == corev1.ConditionTrue
		case c.settings.ConditionType:
			out.Condition = &Condition{Status: string(cond.Status), Reason: cond.Reason, Message: cond.Message}
		}
	}
	switch {
	case d.HasGate:
		out.Gate = "in spec.readinessGates"
	case d.OptOut != "":
		out.Gate = fmt.Sprintf("opted out (%s label %s=%s)", d.OptOut, admission.LabelReadinessGate, admission.OptOutValue)
	case !d.Policy.InMesh:
		out.Gate = "none (not in the mesh)"
	case c.report.Admission.GatePolicy || c.report.Admission.GateWebhook:
		out.Gate = "none: created before the admission policy or webhook, while the webhook was down, or it did not apply"
	default:
		out.Gate = "none: the admission policy is not installed"
	}
	if p.Spec.NodeName != "" {
		out.Agent = c.agentOn(ctx, p.Spec.NodeName)
	}
	out.Verdict, out.Attention = verdict(out)
	return out
}

// agentOn says whether an agent pod serves node.
func (c *Checker) agentOn(ctx context.Context, node string) *Agent {
	if c.agents == nil {
		c.agents = map[string]*corev1.Pod{}
		list, err := c.client.CoreV1().Pods(c.opts.AgentNamespace).List(ctx, metav1.ListOptions{LabelSelector: c.opts.AgentSelector})
		if err != nil {
			c.note("cannot list the agent's pods in %s (%s): whether an agent serves each node is unknown", c.opts.AgentNamespace, short(err))
		} else {
			c.agentsOK = true
			for i := range list.Items {
				ap := &list.Items[i]
				if ap.Spec.NodeName != "" && ap.DeletionTimestamp == nil {
					c.agents[ap.Spec.NodeName] = ap
				}
			}
		}
	}
	if !c.agentsOK {
		return nil
	}
	a := &Agent{}
	if ap := c.agents[node]; ap != nil {
		a.Serves, a.Pod = true, ap.Name
		for _, cond := range ap.Status.Conditions {
			if cond.Type == corev1.PodReady {
				a.Ready = cond.Status == corev1.ConditionTrue
			}
		}
	}
	if n, err := c.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err == nil {
		for _, cond := range n.Status.Conditions {
			if string(cond.Type) == c.opts.NodeConditionType {
				a.NodeCondition = string(cond.Status) + "/" + cond.Reason
			}
		}
	}
	return a
}
