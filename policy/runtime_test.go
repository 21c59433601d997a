package policy

import (
	"errors"
	"strings"
	"testing"
)

// TestCheckRuntime: with the default list, pods under runc, crun or no
// RuntimeClass may be enrolled; gVisor, Kata, an unknown handler and a
// RuntimeClass that does not exist are refused with an error that names the
// class, the handler and the opt-out label.
func TestCheckRuntime(t *testing.T) {
	c := DefaultConfig()
	tests := []struct {
		name           string
		class, handler string
		missing        bool
		want           []string // nil: capturable
	}{
		{"no RuntimeClass", "", "", false, nil},
		{"runc", "standard", "runc", false, nil},
		{"crun", "crun", "crun", false, nil},
		{"gVisor", "gvisor", "runsc", false, []string{`RuntimeClass "gvisor"`, `handler "runsc"`, "istio.io/dataplane-mode=none", "--capturable-runtime-handlers=default,runc,crun"}},
		{"Kata", "kata", "kata-qemu", false, []string{`"kata-qemu"`}},
		{"unknown handler", "fast", "youki", false, []string{`"youki"`}},
		{"RuntimeClass gone", "gvisor", "", true, []string{`RuntimeClass "gvisor" does not exist`}},
		{"a missing RuntimeClass is never capturable", "standard", "runc", true, []string{"does not exist"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := c.CheckRuntime(tt.class, tt.handler, tt.missing)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("CheckRuntime = %v, want capturable", err)
				}
				return
			}
			var ue *UncapturableRuntimeError
			if !errors.As(err, &ue) {
				t.Fatalf("CheckRuntime = %v, want an *UncapturableRuntimeError", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
	// A node whose default runtime is sandboxed: pods without a
	// RuntimeClass are refused once "default" is left out.
	c.CapturableRuntimeHandlers = []string{"runc"}
	if err := c.CheckRuntime("", "", false); err == nil || !strings.Contains(err.Error(), "names no RuntimeClass") {
		t.Errorf("no RuntimeClass without %q in the list: %v, want refused", NoRuntimeClass, err)
	}
}
