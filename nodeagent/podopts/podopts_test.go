package podopts

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/admission/cases"
	"github.com/ambientd/ambientd/iptables"
	"github.com/ambientd/ambientd/podmeta"
)

// loadTable reads the one table of the annotation rules,
// admission/cases/annotations.json, which the shipped admission policy is
// tested against too (test/e2e).
func loadTable(t *testing.T) []cases.AnnotationCase {
	t.Helper()
	cs, err := cases.LoadAnnotations()
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) < 20 {
		t.Fatalf("table has %d cases", len(cs))
	}
	return cs
}

// TestAnnotationTable: ValidateAnnotations calls exactly the table's invalid
// annotations invalid, and Options (for a new pod, DNS capture on) derives
// the table's options and reports the same annotations.
func TestAnnotationTable(t *testing.T) {
	kinds := map[string]bool{}
	for _, c := range loadTable(t) {
		t.Run(c.Name, func(t *testing.T) {
			var got []string
			for _, e := range ValidateAnnotations(c.Annotations) {
				got = append(got, e.Annotation)
				if !strings.Contains(e.Error(), e.Annotation) || !strings.Contains(e.Error(), strconv.Quote(e.Value)) {
					t.Errorf("error %q does not name the annotation and the value", e)
				}
			}
			if !slices.Equal(got, c.Invalid) && !(len(got) == 0 && len(c.Invalid) == 0) {
				t.Errorf("ValidateAnnotations: invalid %v, want %v", got, c.Invalid)
			}
			d := Defaults(true)
			opts, invalid := Options(d, d, c.Annotations)
			want := iptables.PodOptions{DNSCapture: c.Options.DNSCapture, BypassInbound: c.Options.BypassInbound, RerouteInterfaces: c.Options.RerouteInterfaces}
			if opts != want {
				t.Errorf("Options = %+v, want %+v", opts, want)
			}
			if len(invalid) != len(got) {
				t.Errorf("Options reported %d invalid, ValidateAnnotations %d", len(invalid), len(got))
			}
			if err := opts.Validate(); err != nil {
				t.Errorf("Options produced options the rules refuse: %v", err)
			}
		})
		for _, a := range c.Invalid {
			kinds[a] = true
		}
	}
	for _, a := range Annotations {
		if !kinds[a.Name] {
			t.Errorf("the table has no invalid case for %s", a.Name)
		}
	}
}

// An enrolled pod whose annotation turns invalid keeps what it was enrolled
// with; a valid change or a removal applies.
func TestOptionsFallBackToEnrolled(t *testing.T) {
	d := Defaults(true)
	enrolled := iptables.PodOptions{DNSCapture: false, BypassInbound: true, RerouteInterfaces: "tap0"}
	got, invalid := Options(d, enrolled, map[string]string{
		podmeta.AnnotationDNSCapture:               "maybe",
		podmeta.AnnotationBypassInbound:            "yes",
		podmeta.AnnotationRerouteVirtualInterfaces: "+",
	})
	if got != enrolled || len(invalid) != 3 {
		t.Errorf("all invalid: %+v (%d invalid), want the enrolled %+v", got, len(invalid), enrolled)
	}
	if invalid[2].OnInvalid != RefuseNew || invalid[0].OnInvalid != Ignore {
		t.Errorf("reactions: %v %v", invalid[0].OnInvalid, invalid[2].OnInvalid)
	}
	got, _ = Options(d, enrolled, map[string]string{podmeta.AnnotationDNSCapture: "1"})
	if want := (iptables.PodOptions{DNSCapture: true}); got != want {
		t.Errorf("valid change, others removed: %+v, want %+v", got, want)
	}
}

func TestPodOptionsStrict(t *testing.T) {
	if _, err := PodOptions(true, map[string]string{podmeta.AnnotationDNSCapture: "True"}); err != nil {
		t.Errorf("True: %v", err)
	}
	_, err := PodOptions(true, map[string]string{podmeta.AnnotationRerouteVirtualInterfaces: "tap0,+"})
	if err == nil || !strings.Contains(err.Error(), `annotation istio.io/reroute-virtual-interfaces has invalid value "tap0,+"`) || !strings.Contains(err.Error(), `"+" is not an interface name`) {
		t.Errorf("+: %v", err)
	}
}

func TestValidInterfaceName(t *testing.T) {
	for name, ok := range map[string]bool{
		"tap0": true, "eth0.100": true, "k6t-eth0": true, "x_0": true, "abcdefghijklmno": true,
		"_x": false, "0": false, "0tap": false, // a letter first: Istio's pattern, the one rule
		"": false, "+": false, "eth+": false, "*": false, ".": false, "..": false, "-x": false, ".x": false,
		"abcdefghijklmnop": false, "a b": false, "a/b": false, "a,b": false, "a!": false, "a\n": false, "é": false,
	} {
		if err := ValidInterfaceName(name); (err == nil) != ok {
			t.Errorf("ValidInterfaceName(%q) = %v, want valid=%v", name, err, ok)
		}
	}
}
