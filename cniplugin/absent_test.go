package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniplugin/kubeapi"
	"github.com/ambientd/ambientd/podmeta"
)

// answer is how the fake API answers every read: the object (200), or one
// of the errors a real client returns.
type answer string

const (
	ok200      answer = "200"
	notFound   answer = "404"
	denied     answer = "401/403"
	timedOut   answer = "timeout"
	refusedAPI answer = "refused"
)

func (a answer) err() error {
	switch a {
	case notFound:
		return fmt.Errorf("GET …: daemonsets \"ambientd\" not found: %w", kubeapi.ErrNotFound)
	case denied:
		return errors.New("GET …: 401 Unauthorized")
	case timedOut:
		return fmt.Errorf("GET …: %w", context.DeadlineExceeded)
	case refusedAPI:
		return fmt.Errorf("GET …: dial tcp 127.0.0.1:6443: %w", syscall.ECONNREFUSED)
	}
	return nil
}

// fakeAPI answers pod and namespace reads with podAns and the DaemonSet
// read with dsAns, and counts the reads.
type fakeAPI struct {
	pod           *corev1.Pod
	nsLabels      map[string]string
	podAns, dsAns answer
	reads         []string
}

func (f *fakeAPI) Pod(_ context.Context, ns, name string) (*corev1.Pod, error) {
	f.reads = append(f.reads, "pod")
	if err := f.podAns.err(); err != nil {
		return nil, err
	}
	return f.pod, nil
}

func (f *fakeAPI) Namespace(_ context.Context, name string) (*corev1.Namespace, error) {
	f.reads = append(f.reads, "namespace")
	if err := f.podAns.err(); err != nil {
		return nil, err
	}
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: f.nsLabels}}, nil
}

func (f *fakeAPI) DaemonSetGone(context.Context, string, string) (bool, error) {
	f.reads = append(f.reads, "daemonset")
	if f.dsAns == notFound {
		return true, nil
	}
	return false, f.dsAns.err()
}

// TestDecideAbsent is the decision table of docs/install.md, "While no
// agent answers": every state of the lease × the pod's place in the mesh ×
// every answer of the API. The invariant under every row: a pod the agent
// would capture starts only on proof of an uninstall, and then only after
// the plugin finished it; time alone (a lease past its TTL) never lets it
// through.
func TestDecideAbsent(t *testing.T) {
	now := time.Now()
	pol := &cniapi.LeasePolicy{ExcludeNamespaces: []string{"kube-system"}, SystemNamespace: "istio-system",
		ZtunnelLabels: map[string]string{"app": "ztunnel"}, SelfLabels: map[string]string{"app": "ambientd"}, Sidecar: true}
	installed := leaseVerdict{usable: true, lease: cniapi.InstallLease{State: cniapi.LeaseInstalled, Renewed: now,
		DaemonSetNamespace: "istio-system", DaemonSetName: "ambientd", Policy: pol}}
	awayLong := installed
	awayLong.awayLong = true
	noPolicy := installed
	noPolicy.lease.Policy = nil
	noDS := installed
	noDS.lease.DaemonSetName = ""
	noSidecar := installed
	noSidecar.lease.Policy = &cniapi.LeasePolicy{SystemNamespace: "istio-system", Sidecar: false}
	uninstalling := leaseVerdict{usable: true, uninstalling: true, reason: "the agent decided to uninstall"}
	unusable := leaseVerdict{reason: "install lease is not valid JSON; waiting for the agent"}

	pod := func(labels map[string]string, mut ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", UID: types.UID("uid-1"), Labels: labels}}
		for _, m := range mut {
			m(p)
		}
		return p
	}
	ambientNS := map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient}
	plain := pod(nil)
	podLabelled := pod(map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient})
	optOut := pod(map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeNone})
	sidecar := pod(nil, func(p *corev1.Pod) {
		p.Annotations = map[string]string{podmeta.AnnotationSidecarStatus: "{}"}
		p.Spec.Containers = []corev1.Container{{Name: podmeta.ContainerProxy, Args: []string{"proxy", "sidecar"}}}
	})
	hostNet := pod(nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true })

	type row struct {
		name     string
		lease    leaseVerdict
		noCreds  bool
		pod      *corev1.Pod
		nsLabels map[string]string
		podAns   answer
		dsAns    answer
		uid      string
		// want: refuse, pass, uninstall (pass after finishing it)
		want string
	}
	rows := []row{
		// The lease alone decides, before the API.
		{name: "uninstalling: finish and pass", lease: uninstalling, pod: podLabelled, nsLabels: ambientNS, want: "uninstall"},
		{name: "uninstalling, API down: still the agent's own decision", lease: uninstalling, pod: podLabelled, podAns: refusedAPI, want: "uninstall"},
		{name: "no or untrusted lease: every pod waits", lease: unusable, pod: plain, want: "refuse"},
		{name: "lease without policy: every pod waits", lease: noPolicy, pod: plain, want: "refuse"},
		{name: "no credentials: every pod waits", lease: installed, noCreds: true, pod: plain, want: "refuse"},
	}
	// Pods outside the mesh start on any lease the plugin can use, but only
	// when the API answered for both the pod and its namespace.
	for _, p := range []struct {
		name     string
		pod      *corev1.Pod
		nsLabels map[string]string
	}{
		{"plain pod", plain, nil},
		{"opted out in an ambient namespace", optOut, ambientNS},
		{"hostNetwork in an ambient namespace", hostNet, ambientNS},
		{"sidecar pod, sidecar mode off", sidecar, nil},
	} {
		l := installed
		if p.pod == sidecar {
			l = noSidecar
		}
		for _, a := range []answer{ok200, notFound, denied, timedOut, refusedAPI} {
			want := "refuse"
			if a == ok200 {
				want = "pass"
			}
			rows = append(rows, row{name: p.name + ", API " + string(a), lease: l, pod: p.pod, nsLabels: p.nsLabels, podAns: a, dsAns: ok200, want: want})
		}
	}
	// Pods in the mesh: only the API's NotFound for the DaemonSet is proof.
	for _, p := range []struct {
		name     string
		pod      *corev1.Pod
		nsLabels map[string]string
	}{
		{"pod in an ambient namespace", plain, ambientNS},
		{"ambient pod label in a plain namespace", podLabelled, nil},
		{"sidecar pod, sidecar mode on", sidecar, nil},
	} {
		for _, l := range []struct {
			name string
			v    leaseVerdict
		}{{"installed", installed}, {"past its TTL", awayLong}} {
			for _, a := range []answer{ok200, notFound, denied, timedOut, refusedAPI} {
				want := "refuse"
				if a == notFound {
					want = "uninstall"
				}
				rows = append(rows, row{name: fmt.Sprintf("%s, lease %s, DaemonSet %s", p.name, l.name, a), lease: l.v, pod: p.pod, nsLabels: p.nsLabels, podAns: ok200, dsAns: a, want: want})
			}
		}
		rows = append(rows, row{name: p.name + ", lease names no DaemonSet", lease: noDS, pod: p.pod, nsLabels: p.nsLabels, dsAns: notFound, want: "refuse"})
	}
	// A pod outside the mesh asks about the DaemonSet only once the agent
	// is away for longer than the TTL, and starts whatever the answer.
	for _, a := range []answer{ok200, notFound, denied, timedOut, refusedAPI} {
		want := "pass"
		if a == notFound {
			want = "uninstall"
		}
		rows = append(rows, row{name: "plain pod, lease past its TTL, DaemonSet " + string(a), lease: awayLong, pod: plain, dsAns: a, want: want})
	}
	rows = append(rows, row{name: "plain pod, lease fresh, DaemonSet gone: not asked", lease: installed, pod: plain, dsAns: notFound, want: "pass"})
	rows = append(rows,
		row{name: "the API's pod is another (recreated under the same name)", lease: installed, pod: plain, uid: "uid-2", want: "refuse"},
		row{name: "excluded namespace read from the lease's policy", lease: installed, pod: pod(nil, func(p *corev1.Pod) { p.Namespace = "kube-system" }), nsLabels: ambientNS, want: "pass"},
	)

	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			if r.podAns == "" {
				r.podAns = ok200
			}
			if r.dsAns == "" {
				r.dsAns = ok200
			}
			uid := r.uid
			if uid == "" {
				uid = string(r.pod.UID)
			}
			f := &fakeAPI{pod: r.pod, nsLabels: r.nsLabels, podAns: r.podAns, dsAns: r.dsAns}
			var api apiReader = f
			var apiErr error
			if r.noCreds {
				api, apiErr = nil, errors.New("open /opt/cni/bin/ambientd-cni.kubeconfig: no such file or directory")
			}
			d := decideAbsent(context.Background(), r.lease, api, apiErr, &cniapi.Pod{Namespace: r.pod.Namespace, Name: r.pod.Name, Uid: uid})
			got := "refuse"
			switch {
			case d.pass && d.uninstall:
				got = "uninstall"
			case d.pass:
				got = "pass"
			case d.uninstall:
				t.Fatalf("uninstall without passing: %+v", d)
			}
			if got != r.want {
				t.Fatalf("got %s (%s); want %s", got, d.reason, r.want)
			}
			if d.reason == "" {
				t.Error("no reason given")
			}
			if got == "refuse" && !strings.Contains(d.reason, "waiting for") {
				t.Errorf("a refusal must say the pod waits for the agent: %q", d.reason)
			}
			if d.mesh && got == "pass" {
				t.Errorf("a mesh pod passed without an uninstall: %+v", d)
			}
		})
	}
}
