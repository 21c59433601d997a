package check

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"strings"
)

// WriteTable writes r as a table, then the notes.
func WriteTable(w io.Writer, r Report) error {
	var b bytes.Buffer
	fmt.Fprintf(&b, "settings: %s (excluded namespaces %s, system namespace %s, condition %s)\n",
		r.Settings.Source, strings.Join(r.Settings.ExcludeNamespaces, ","), r.Settings.SystemNamespace, r.Settings.ConditionType)
	switch {
	case !r.Admission.Known:
		fmt.Fprintf(&b, "admission: unknown (cannot list admission policies)\n")
	default:
		fmt.Fprintf(&b, "admission: gate policy %s, gate webhook %s, annotation policy %s\n", installed(r.Admission.GatePolicy), installed(r.Admission.GateWebhook), installed(r.Admission.AnnotationPolicy))
	}
	rows := [][]string{{"POD", "MESH", "DECIDED BY", "GATE", "NODE", "AGENT", "ANNOTATION", "CONDITION", "VERDICT"}}
	for _, p := range r.Pods {
		name := p.Namespace + "/" + p.Name
		if p.Kind != "Pod" {
			name = p.Kind + " " + name
		}
		cond, agent := "-", "-"
		if p.Condition != nil {
			cond = p.Condition.Status + "/" + p.Condition.Reason
		}
		if p.Agent != nil {
			switch {
			case !p.Agent.Serves:
				agent = "none"
			case p.Agent.Ready:
				agent = "ready"
			default:
				agent = "not-ready"
			}
		}
		mesh := map[bool]string{true: "yes", false: "no"}[p.Enrolled]
		rows = append(rows, []string{name, mesh, p.DecidedBy, gateCell(p), orDash(p.Node), agent, orDash(p.Redirection), cond, p.Verdict})
	}
	writeRows(&b, rows)
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	_, err := w.Write(b.Bytes())
	return err
}

func gateCell(p Pod) string {
	if p.Gated {
		return "yes"
	}
	if strings.HasPrefix(p.Gate, "opted out") {
		return "opted-out"
	}
	return "no"
}

func installed(b bool) string {
	if b {
		return "installed"
	}
	return "NOT installed"
}

// orDash is s, or "-" for an empty cell.
func orDash(s string) string {
	return cmp.Or(s, "-")
}

// writeRows aligns columns with two spaces (the last column is not padded).
func writeRows(b *bytes.Buffer, rows [][]string) {
	width := map[int]int{}
	for _, r := range rows {
		for i, c := range r {
			width[i] = max(width[i], len(c))
		}
	}
	for _, r := range rows {
		for i, c := range r {
			if i == len(r)-1 {
				b.WriteString(c)
				break
			}
			b.WriteString(c)
			b.WriteString(strings.Repeat(" ", width[i]-len(c)+2))
		}
		b.WriteString("\n")
	}
}

// Attention counts the pods the user should look at.
func (r Report) Attention() int {
	n := 0
	for _, p := range r.Pods {
		if p.Attention {
			n++
		}
	}
	return n
}
