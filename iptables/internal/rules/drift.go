package rules

import "strings"

// Drift is the difference between the rules a pod (or the node) should have
// and the rules it has, one readable line per rule ("iptables -t nat -A
// ISTIO_OUTPUT ...", "nft inet istio-ambient-nat istio-output: ...").
type Drift struct {
	Missing    []string
	Unexpected []string
}

// Empty reports whether there is no drift.
func (d Drift) Empty() bool { return len(d.Missing) == 0 && len(d.Unexpected) == 0 }

func (d Drift) String() string {
	if d.Empty() {
		return "no drift"
	}
	var b strings.Builder
	for _, m := range d.Missing {
		b.WriteString("missing: " + m + "\n")
	}
	for _, u := range d.Unexpected {
		b.WriteString("unexpected: " + u + "\n")
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// Add appends o's lines to d's.
func (d *Drift) Add(o Drift) {
	d.Missing = append(d.Missing, o.Missing...)
	d.Unexpected = append(d.Unexpected, o.Unexpected...)
}

// MultisetDiff returns the elements of want not in have and of have not in
// want, counting duplicates.
func MultisetDiff(want, have []string) (missing, unexpected []string) {
	count := map[string]int{}
	for _, h := range have {
		count[h]++
	}
	for _, w := range want {
		if count[w] > 0 {
			count[w]--
			continue
		}
		missing = append(missing, w)
	}
	for _, h := range have {
		if count[h] > 0 {
			count[h]--
			unexpected = append(unexpected, h)
		}
	}
	return missing, unexpected
}
