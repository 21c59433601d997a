// Package podopts is the one home of the validation of the annotations a
// pod may carry for the agent (ValidateAnnotations: what the agent calls
// invalid, and what an admission policy must refuse), and of the parsing of
// a pod's capture options from them. The rules package gets plain
// PodOptions.
package podopts

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/podmeta"
)

// Kind is how an annotation's value is read.
type Kind string

const (
	// KindBool: what strconv.ParseBool accepts (Istio's rule): 1, t, T,
	// TRUE, true, True, 0, f, F, FALSE, false, False. Nothing else, not
	// even the empty string.
	KindBool Kind = "bool"
	// KindInterfaces: a comma-separated list; each item, with spaces
	// around it trimmed, is empty (skipped) or an interface name (see
	// ValidInterfaceName). The empty value lists none.
	KindInterfaces Kind = "interfaces"
)

// Annotation is one pod annotation the agent reads to choose a pod's
// capture, and what it does with an invalid value.
type Annotation struct {
	Name string
	Kind Kind
	// OnInvalid is what the agent does when the value is invalid
	// (docs/agent.md, "Pod annotations").
	OnInvalid Reaction
}

// Reaction is the agent's answer to an invalid annotation value. Either way
// it records a Warning Event (agent.EventInvalidAnnotation) naming the
// annotation and the value.
type Reaction string

const (
	// Ignore: the value is ignored, as Istio ignores an unparsable
	// boolean: a new pod gets the node's default, an enrolled pod keeps
	// the value it was enrolled with (and is verified against it).
	Ignore Reaction = "ignore"
	// RefuseNew: a new pod is not enrolled (its CNI ADD fails, so it never
	// starts with traffic routed otherwise than asked); an enrolled pod
	// keeps the value it was enrolled with.
	RefuseNew Reaction = "refuse-new"
)

// Annotations is the table of the pod annotations the agent reads, sorted
// by name. It is the one definition of their validity: ValidateAnnotations
// and Options follow it, and an admission policy checking the same rules
// can be tested against admission/cases/annotations.json.
var Annotations = []Annotation{
	{Name: podmeta.AnnotationBypassInbound, Kind: KindBool, OnInvalid: Ignore},
	{Name: podmeta.AnnotationDNSCapture, Kind: KindBool, OnInvalid: Ignore},
	{Name: podmeta.AnnotationRerouteVirtualInterfaces, Kind: KindInterfaces, OnInvalid: RefuseNew},
}

// MaxInterfaceNameLen is the longest Linux interface name (IFNAMSIZ - 1).
const MaxInterfaceNameLen = iptables.MaxInterfaceNameLen

// ValidInterfaceName reports whether name is one exact interface name (the
// rule the rule backends enforce: iptables.ValidInterfaceName).
func ValidInterfaceName(name string) error { return iptables.ValidInterfaceName(name) }

// InvalidAnnotationError is one annotation whose value the agent cannot use.
type InvalidAnnotationError struct {
	Annotation string
	Value      string
	Reason     string
	OnInvalid  Reaction
}

func (e *InvalidAnnotationError) Error() string {
	return fmt.Sprintf("annotation %s has invalid value %q: %s", e.Annotation, e.Value, e.Reason)
}

// ValidateAnnotations returns the annotations of the table whose value in
// annotations is invalid, sorted by annotation name; none when every one of
// them is absent or valid. Other annotations are not looked at.
func ValidateAnnotations(annotations map[string]string) []*InvalidAnnotationError {
	var out []*InvalidAnnotationError
	for _, a := range Annotations {
		v, ok := annotations[a.Name]
		if !ok {
			continue
		}
		if _, err := parse(a, v); err != nil {
			out = append(out, err)
		}
	}
	return out
}

// value is a parsed annotation: a bool or a canonical interface list.
type value struct {
	b    bool
	list string
}

func parse(a Annotation, v string) (value, *InvalidAnnotationError) {
	bad := func(reason string) (value, *InvalidAnnotationError) {
		return value{}, &InvalidAnnotationError{Annotation: a.Name, Value: v, Reason: reason, OnInvalid: a.OnInvalid}
	}
	switch a.Kind {
	case KindBool:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return bad("want a boolean (true, false, 1, 0, t, f, in any of Go's strconv.ParseBool spellings)")
		}
		return value{b: b}, nil
	case KindInterfaces:
		l, err := parseInterfaces(v)
		if err != nil {
			return bad(err.Error())
		}
		return value{list: l}, nil
	}
	return bad("unknown annotation kind " + string(a.Kind))
}

// parseInterfaces turns "tap0, tap1" into the canonical "tap0,tap1"
// (spaces around names and empty items dropped, duplicates once, in the
// order given), each name checked.
func parseInterfaces(v string) (string, error) {
	var names []string
	for _, f := range strings.Split(v, ",") {
		f = strings.TrimSpace(f)
		if f == "" || slices.Contains(names, f) {
			continue
		}
		if err := ValidInterfaceName(f); err != nil {
			return "", err
		}
		names = append(names, f)
	}
	return strings.Join(names, ","), nil
}

// Defaults are the capture options of a pod without annotations on a node
// whose DNS capture default is dnsCapture.
func Defaults(dnsCapture bool) iptables.PodOptions {
	return iptables.PodOptions{DNSCapture: dnsCapture}
}

// Options derives a pod's capture options from its annotations: each
// annotation of the table that is present and valid sets its option; an
// absent one leaves the default's; an invalid one leaves base's and is
// returned (as ValidateAnnotations returns it). base is Defaults(...) for a
// pod not enrolled yet, and the options it was enrolled with for an enrolled
// pod, so a value turned invalid changes nothing of what the pod has.
func Options(defaults, base iptables.PodOptions, annotations map[string]string) (iptables.PodOptions, []*InvalidAnnotationError) {
	out := defaults
	var invalid []*InvalidAnnotationError
	for _, a := range Annotations {
		v, ok := annotations[a.Name]
		if !ok {
			continue
		}
		val, err := parse(a, v)
		switch a.Name {
		case podmeta.AnnotationBypassInbound:
			out.BypassInbound = pick(err == nil, val.b, base.BypassInbound)
		case podmeta.AnnotationDNSCapture:
			out.DNSCapture = pick(err == nil, val.b, base.DNSCapture)
		case podmeta.AnnotationRerouteVirtualInterfaces:
			out.RerouteInterfaces = pick(err == nil, val.list, base.RerouteInterfaces)
		}
		if err != nil {
			invalid = append(invalid, err)
		}
	}
	sort.Slice(invalid, func(i, j int) bool { return invalid[i].Annotation < invalid[j].Annotation })
	return out, invalid
}

func pick[T any](ok bool, v, fallback T) T {
	if ok {
		return v
	}
	return fallback
}

// PodOptions derives a pod's capture options from the node's DNS capture
// default and the pod's annotations, failing on the first invalid one (for
// tools that show a pod's rules; the agent uses Options).
func PodOptions(dnsCaptureDefault bool, annotations map[string]string) (iptables.PodOptions, error) {
	d := Defaults(dnsCaptureDefault)
	opts, invalid := Options(d, d, annotations)
	if len(invalid) > 0 {
		return iptables.PodOptions{}, invalid[0]
	}
	return opts, nil
}
