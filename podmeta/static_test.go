package podmeta

import "testing"

// TestAPIAssigned: the apiserver's uids are canonical UUIDs; the kubelet's
// static uids (an md5 hex of the manifest) are not, so a runtime uid of
// that form is known at once to be no API pod's.
func TestAPIAssigned(t *testing.T) {
	for uid, want := range map[string]bool{
		"0f8e9d2c-1b3a-4c5d-8e7f-9a0b1c2d3e4f": true,
		"0F8E9D2C-1B3A-4C5D-8E7F-9A0B1C2D3E4F": true,
		"6a1b2c3d4e5f60718293a4b5c6d7e8f9":     false, // kubelet's md5 hex
		"0f8e9d2c1b3a4c5d8e7f9a0b1c2d3e4f":     false, // UUID without dashes: never what the apiserver writes
		"0f8e9d2c-1b3a-4c5d-8e7f-9a0b1c2d3e4":  false,
		"0f8e9d2c-1b3a-4c5d-8e7f-9a0b1c2d3e4g": false,
		"0f8e9d2c+1b3a-4c5d-8e7f-9a0b1c2d3e4f": false,
		"":                                     false,
	} {
		if got := APIAssigned(uid); got != want {
			t.Errorf("APIAssigned(%q) = %v, want %v", uid, got, want)
		}
	}
}
