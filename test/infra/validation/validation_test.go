package validation

import (
	"strings"
	"testing"
	"time"
)

// TestParseArgs: the injected istio-validation container's args are read
// (the ports, the probe port and timeout), the rule flags it passes are
// ignored, and anything but a validation run is refused.
func TestParseArgs(t *testing.T) {
	injected := strings.Fields("istio-iptables -p 15001 -z 15006 -u 1337 -m REDIRECT -i * -x  -b * -d 15090,15021,15020 --log_output_level=default:info --run-validation --skip-rule-apply")
	// The injector passes -x "" as an empty argument.
	injected = append(injected[:10], append([]string{""}, injected[10:]...)...)
	c, err := ParseArgs(injected)
	if err != nil {
		t.Fatal(err)
	}
	if c != DefaultConfig() {
		t.Errorf("config %+v, want the defaults %+v", c, DefaultConfig())
	}
	c, err = ParseArgs([]string{"-p", "16001", "-z=ignored", "--inbound-capture-port=16006", "--iptables-probe-port", "16002", "--probe-timeout=2s", "--run-validation"})
	if err != nil {
		t.Fatal(err)
	}
	if c.OutboundPort != 16001 || c.InboundPort != 16006 || c.ProbePort != 16002 || c.Timeout != 2*time.Second {
		t.Errorf("config %+v", c)
	}
	for _, bad := range [][]string{
		{"istio-iptables", "-p", "15001"},                  // no --run-validation: would be asked to program rules
		{"-p", "70000", "--run-validation"},                // not a port
		{"--probe-timeout=-1s", "--run-validation"},        // not positive
		{"--run-validation", "-z"},                         // missing value
		{"--iptables-probe-port", "x", "--run-validation"}, // not a port
	} {
		if _, err := ParseArgs(bad); err == nil {
			t.Errorf("ParseArgs(%q) accepted", bad)
		}
	}
}

// TestMainUsage: bad arguments exit 1 (not 126: the repair controller must
// not act on a misconfigured container as on missing rules).
func TestMainUsage(t *testing.T) {
	if code, msg := Main(t.Context(), []string{"-p", "15001"}); code != ExitUsage || !strings.Contains(msg, "--run-validation") {
		t.Errorf("Main without --run-validation: %d %q", code, msg)
	}
}
