package check

import (
	"context"
	"fmt"
	"io"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/admission"
	"github.com/ambientd/ambientd/admission/inject"
)

// Manifest checks the pod templates of a manifest stream (the same kinds
// as `ambientd inject`), in namespace defaultNS when a document names none:
// would each pod be enrolled and gated if applied now.
func (c *Checker) Manifest(ctx context.Context, r io.Reader, defaultNS string) (Report, error) {
	res, err := inject.Inject(r, io.Discard, inject.Options{
		Settings:  c.settings,
		Namespace: defaultNS,
		NamespaceLabels: func(ns string) (map[string]string, bool) {
			return c.namespaceLabels(ctx, ns)
		},
		Warn: func(m string) { c.note("%s", m) },
	})
	if err != nil {
		return Report{}, err
	}
	rep := c.report
	rep.Pods = []Pod{}
	for _, t := range res.Templates {
		rep.Pods = append(rep.Pods, c.template(t))
	}
	rep.Notes = slices.Clone(c.report.Notes)
	return rep, nil
}

func (c *Checker) template(t inject.Template) Pod {
	d := t.Decision
	fake := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: t.Namespace, Name: t.Name}}
	p := Pod{
		Namespace: t.Namespace, Name: t.Name, Kind: t.Kind,
		Enrolled: d.Policy.InMesh, Reason: string(d.Policy.Reason), DecidedBy: c.decidedBy(fake, d.Policy),
	}
	switch {
	case d.HasGate:
		p.Gated, p.Gate = true, "in the manifest"
	case d.OptOut != "":
		p.Gate = fmt.Sprintf("opted out (%s label %s=%s)", d.OptOut, admission.LabelReadinessGate, admission.OptOutValue)
	case !d.Policy.InMesh:
		p.Gate = "none (not in the mesh)"
	case c.report.Admission.GatePolicy:
		p.Gated, p.Gate = true, "added at admission by "+admission.MutatingPolicyName
	case c.report.Admission.GateWebhook:
		p.Gated, p.Gate = true, "added at admission by the webhook "+admission.WebhookName
	default:
		p.Gate = "none: the admission policy is not installed (ambientd inject adds it)"
	}
	switch {
	case !p.Enrolled:
		p.Verdict = "will not be in the mesh"
	case p.Gated:
		p.Verdict = "will be enrolled; Ready only once meshed"
	default:
		p.Verdict, p.Attention = "will be enrolled, but NOT gated: Ready will not wait for the mesh", d.OptOut == ""
	}
	return p
}
