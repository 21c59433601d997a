package podmeta

import (
	"strings"
	"testing"

	"github.com/ambientd/ambientd/iptables"
)

func TestPodOptions(t *testing.T) {
	tests := []struct {
		name    string
		dns     bool
		ann     map[string]string
		want    iptables.PodOptions
		wantErr string
	}{
		{name: "defaults off", want: iptables.PodOptions{}},
		{name: "node dns on", dns: true, want: iptables.PodOptions{DNSCapture: true}},
		{name: "pod turns dns off", dns: true, ann: map[string]string{AnnotationDNSCapture: "false"}, want: iptables.PodOptions{}},
		{name: "pod turns dns on", ann: map[string]string{AnnotationDNSCapture: "true"}, want: iptables.PodOptions{DNSCapture: true}},
		{name: "bypass", ann: map[string]string{AnnotationBypassInbound: "true"}, want: iptables.PodOptions{BypassInbound: true}},
		{name: "bypass false", ann: map[string]string{AnnotationBypassInbound: "false"}, want: iptables.PodOptions{}},
		{name: "unrelated annotations ignored", ann: map[string]string{"foo": "bar"}, want: iptables.PodOptions{}},
		{name: "bypass yes", ann: map[string]string{AnnotationBypassInbound: "yes"}, wantErr: `annotation ambient.istio.io/bypass-inbound-capture has invalid value "yes"`},
		{name: "bypass True", ann: map[string]string{AnnotationBypassInbound: "True"}, wantErr: `"True"`},
		{name: "dns empty", ann: map[string]string{AnnotationDNSCapture: ""}, wantErr: `annotation ambient.istio.io/dns-capture has invalid value ""`},
		{name: "reroute", ann: map[string]string{AnnotationRerouteVirtualInterfaces: "tap0"}, want: iptables.PodOptions{RerouteInterfaces: "tap0"}},
		{name: "reroute list canonical", ann: map[string]string{AnnotationRerouteVirtualInterfaces: " tap0, tap1,,tap0 "}, want: iptables.PodOptions{RerouteInterfaces: "tap0,tap1"}},
		{name: "reroute empty", ann: map[string]string{AnnotationRerouteVirtualInterfaces: ""}, want: iptables.PodOptions{}},
		{name: "reroute bad name", ann: map[string]string{AnnotationRerouteVirtualInterfaces: "tap0,eth0!"}, wantErr: `annotation istio.io/reroute-virtual-interfaces has invalid value "tap0,eth0!": reroute interface "eth0!" is not a valid interface name`},
		{name: "reroute too long", ann: map[string]string{AnnotationRerouteVirtualInterfaces: "waytoolonginterfacename"}, wantErr: `"waytoolonginterfacename" is not a valid interface name`},
		{name: "dns 1", ann: map[string]string{AnnotationDNSCapture: "1"}, wantErr: `ambient.istio.io/dns-capture has invalid value "1"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := PodOptions(tt.dns, tt.ann)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
