package rules

import "testing"

func TestPodOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		reroute string
		ok      bool
	}{
		{"", true},
		{"tap0", true},
		{"tap0,vm-eth1", true},
		{"tap0,", false},
		{",tap0", false},
		{"tap 0", false},
		{"waytoolonginterfacename", false},
		{"eth0!", false},
		{"..", false},
	} {
		err := PodOptions{RerouteInterfaces: tc.reroute}.Validate()
		if (err == nil) != tc.ok {
			t.Errorf("Validate(RerouteInterfaces %q) = %v, want ok=%v", tc.reroute, err, tc.ok)
		}
	}
}
