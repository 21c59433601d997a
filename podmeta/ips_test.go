package podmeta

import (
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestIPs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status corev1.PodStatus
		want   string
	}{
		{"none", corev1.PodStatus{}, "[]"},
		{"podIPs, both families", corev1.PodStatus{PodIP: "10.0.0.9", PodIPs: []corev1.PodIP{{IP: "10.0.0.1"}, {IP: "fd00::1"}}}, "[10.0.0.1 fd00::1]"},
		{"podIP only (older kubelet)", corev1.PodStatus{PodIP: "10.0.0.2"}, "[10.0.0.2]"},
		{"v4-mapped v6 unmapped", corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "::ffff:10.0.0.3"}}}, "[10.0.0.3]"},
		{"garbage skipped", corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "not-an-ip"}, {IP: "10.0.0.4"}}}, "[10.0.0.4]"},
		{"only garbage: podIP", corev1.PodStatus{PodIP: "10.0.0.5", PodIPs: []corev1.PodIP{{IP: "x"}}}, "[10.0.0.5]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := fmt.Sprint(IPs(&corev1.Pod{Status: tc.status})); got != tc.want {
				t.Errorf("IPs = %s, want %s", got, tc.want)
			}
		})
	}
}
