//go:build e2e

package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/daemon"
	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/e2eenv"
	"github.com/ambientd/ambientd/test/infra/testutil"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

// While no agent answers (docs/install.md, "While no agent answers"): the
// plugin reads the pod and its namespace from the API with the credentials
// the installer left it and applies the agent's own policy. Pods outside
// the mesh start; mesh pods wait, and start enrolled once an agent is back;
// with the API unreachable too, every pod waits. Nothing but proof of an
// uninstall ever lets a mesh pod through.

// attempt runs the runtime's chain for the pod object obj, as the kubelet
// retries a sandbox; it returns the CNI error, nil when the pod started.
func (n *leaseNode) attempt(t *testing.T, ctx context.Context, obj *corev1.Pod) (*e2eenv.Pod, error) {
	t.Helper()
	p, err := testEnv.AttachPod(ctx, obj, n.chain)
	if err == nil {
		t.Cleanup(func() {
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_ = testEnv.DeletePod(cctx, p)
		})
	}
	return p, err
}

// objectWith creates the pod object (no sandbox) with labels.
func objectWith(t *testing.T, ctx context.Context, namespace, name string, labels map[string]string) *corev1.Pod {
	t.Helper()
	obj := createObjectOnly(t, ctx, namespace, name)
	if len(labels) == 0 {
		return obj
	}
	obj.Labels = labels
	obj, err := testEnv.CP.Admin.CoreV1().Pods(namespace).Update(ctx, obj, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return obj
}

// refusedForTheAgent fails the test unless err is the ADD failing closed
// while the agent is away ("agent unreachable", try again later).
func (n *leaseNode) refusedForTheAgent(t *testing.T, err error, what string) {
	t.Helper()
	cerr, ok := e2eenv.IsCNIError(err)
	if !ok || cerr.Code != 11 || !strings.Contains(cerr.Msg, "agent unreachable") {
		t.Fatalf("%s: %v; want the ADD to fail closed (code 11, agent unreachable)\nplugin log:\n%s", what, err, lastLines(n.pluginLogText(), 20))
	}
	if !n.installed() {
		t.Fatalf("%s: the plugin is no longer installed after a failed-closed ADD", what)
	}
}

// TestAgentAwayOnlyTheMeshWaits: the agent SIGKILLed and kept down. A pod
// in an unlabelled namespace starts, and so does one opted out with
// istio.io/dataplane-mode=none in an ambient namespace; a pod in an
// ambient namespace and one labelled ambient in an unlabelled namespace
// wait. With the API server stopped too, every pod waits, plain ones
// included: the plugin cannot tell. Once an agent is back, the waiting
// pods start enrolled and captured, and the node's Event tells what
// happened meanwhile.
func TestAgentAwayOnlyTheMeshWaits(t *testing.T) {
	ctx := testutil.Context(t, 5*time.Minute)
	n := newLeaseNode(t)
	n.withDaemonSet(t, ctx)
	em := startEmulator(t, ctx, "ztunnel-away")
	ambient, plain := uniqueNS("away-ambient"), uniqueNS("away-plain")
	createNamespace(t, ctx, ambient, true)
	createNamespace(t, ctx, plain, false)
	// The plugin reads as its own read-only service account (the chart's
	// setting), with a token the agent minted, which outlives the agent.
	const asPlugin = "--cni-plugin-service-account=ambientd-cni"
	a := n.start(t, ctx, "agent-away", asPlugin)
	kill(t, a)
	kc := filepath.Join(n.binDir, cniapi.PluginType+cniapi.KubeconfigSuffix)
	if fi, err := os.Stat(kc); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the plugin's kubeconfig %s: %v, %v; want mode 0600", kc, fi, err)
	}
	if b, _ := os.ReadFile(kc); strings.Contains(string(b), testEnv.CP.AgentToken) {
		t.Fatalf("the plugin's kubeconfig holds the agent's own token, not one of ambientd-cni's")
	}

	start := time.Now()
	if _, err := n.attempt(t, ctx, objectWith(t, ctx, plain, "plain", nil)); err != nil {
		t.Fatalf("a pod in an unlabelled namespace with no agent: %v\nplugin log:\n%s", err, lastLines(n.pluginLogText(), 20))
	}
	t.Logf("a pod outside the mesh started %v after its ADD began, with no agent", time.Since(start).Round(time.Millisecond))
	if _, err := n.attempt(t, ctx, objectWith(t, ctx, ambient, "opted-out", map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeNone})); err != nil {
		t.Fatalf("a pod opted out in an ambient namespace with no agent: %v", err)
	}
	inNS := objectWith(t, ctx, ambient, "in-ns", nil)
	_, err := n.attempt(t, ctx, inNS)
	n.refusedForTheAgent(t, err, "a pod in an ambient namespace with no agent")
	labelled := objectWith(t, ctx, plain, "labelled", map[string]string{podmeta.LabelDataplaneMode: podmeta.ModeAmbient})
	_, err = n.attempt(t, ctx, labelled)
	n.refusedForTheAgent(t, err, "a pod labelled ambient with no agent")

	// The API unreachable as well: the plugin cannot tell, so nothing
	// starts. (The pod object is created first.)
	noAPI := objectWith(t, ctx, plain, "no-api", nil)
	resume := pauseAPIServer(t)
	start = time.Now()
	_, err = n.attempt(t, ctx, noAPI)
	n.refusedForTheAgent(t, err, "a plain pod with neither agent nor API")
	t.Logf("with no API either, the plain pod's ADD failed closed after %v", time.Since(start).Round(time.Millisecond))
	resume()
	if err := testEnv.CP.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	// The agent back: the waiting pods start enrolled and captured.
	n.start(t, ctx, "agent-away-back", asPlugin)
	for _, obj := range []*corev1.Pod{inNS, labelled} {
		p, err := n.attempt(t, ctx, obj)
		if err != nil {
			t.Fatalf("%s/%s with the agent back: %v", obj.Namespace, obj.Name, err)
		}
		waitAnnotation(t, ctx, p, "enabled")
		if rules := podRules(t, p); !strings.Contains(rules, "15001") {
			t.Errorf("%s/%s enrolled without capture rules:\n%s", obj.Namespace, obj.Name, rules)
		}
		waitEmu(t, ctx, em, "ztunnel has "+obj.Name, func(st ztunnelemu.State) bool { return countOps(st, "add", string(obj.UID)) > 0 })
	}
	ev := nodeEvent(t, ctx, daemon.EventAgentAbsent)
	for _, want := range []string{"without the mesh agent", "3 pods waited", "2 outside the mesh started"} {
		if !strings.Contains(ev.Message, want) {
			t.Errorf("node Event %s: %q does not say %q", ev.Reason, ev.Message, want)
		}
	}
	t.Logf("node Event: %s", ev.Message)
}

// nodeEvent waits for the agent's Event of reason on its node.
func nodeEvent(t *testing.T, ctx context.Context, reason string) corev1.Event {
	t.Helper()
	sel := fields.Set{"involvedObject.kind": "Node", "involvedObject.name": testEnv.NodeName, "reason": reason}.AsSelector().String()
	var ev corev1.Event
	testutil.Eventually(t, "node Event "+reason, 30*time.Second, func() bool {
		evs, err := testEnv.CP.Admin.CoreV1().Events(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: sel})
		if err != nil || len(evs.Items) == 0 {
			return false
		}
		ev = slices.MaxFunc(evs.Items, func(a, b corev1.Event) int { return a.LastTimestamp.Compare(b.LastTimestamp.Time) })
		return true
	})
	return ev
}

// TestNoFailOpenOnTime: the agent away for far longer than the install
// lease's TTL while its DaemonSet exists (an image that cannot be pulled,
// a missing ConfigMap, a crash before the lease is renewed): mesh pods
// keep waiting and the plugin stays installed. Time alone never lets a
// mesh pod start uncaptured.
func TestNoFailOpenOnTime(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	n, ambient := newInstalledNode(t, ctx, "no-timer")
	const ttl = 3 * time.Second
	n.env = []string{"AMBIENTD_CNI_INSTALL_LEASE_TTL=" + ttl.String()}
	a := n.start(t, ctx, "agent-no-timer")
	kill(t, a)
	killed := time.Now()
	for i := 0; time.Since(killed) < 4*ttl; i++ {
		n.waitsForAgent(t, ctx, ambient, fmt.Sprintf("mesh-%d", i), fmt.Sprintf("%v after the kill (lease TTL %v)", time.Since(killed).Round(time.Second), ttl))
		time.Sleep(ttl / 2)
	}
	if log := n.pluginLogText(); !strings.Contains(log, "DaemonSet "+n.ds.GetNamespace()+"/"+n.ds.GetName()+" exists: waiting for its agent") {
		t.Errorf("the plugin did not log why it waits:\n%s", lastLines(log, 10))
	}
}

// TestBadSettingCrashLoop: an upgrade to a config with a value that fails
// to parse (AMBIENTD_DNS_CAPTURE=yes): the agent exits at start, restarted
// again and again for longer than the install lease's TTL. Every start
// still writes the lease and the plugin's credentials, so pods outside the
// mesh start and mesh pods wait; none starts uncaptured; the node's Event
// names the bad setting.
func TestBadSettingCrashLoop(t *testing.T) {
	ctx := testutil.Context(t, 4*time.Minute)
	n, ambient := newInstalledNode(t, ctx, "bad-setting")
	const ttl = 3 * time.Second
	n.env = []string{"AMBIENTD_CNI_INSTALL_LEASE_TTL=" + ttl.String()}
	kill(t, n.start(t, ctx, "agent-before-upgrade"))
	n.env = append(n.env, "AMBIENTD_DNS_CAPTURE=yes")
	started := time.Now()
	for i := 0; time.Since(started) < 4*ttl; i++ {
		a := n.spawn(t, ctx, fmt.Sprintf("agent-bad-setting-%d", i))
		<-a.Exited()
		if i == 0 {
			if !strings.Contains(a.Logs(), "AMBIENTD_DNS_CAPTURE") {
				t.Fatalf("the agent did not name the bad setting:\n%s", a.LogTail(10))
			}
		}
		n.waitsForAgent(t, ctx, ambient, fmt.Sprintf("mesh-%d", i), fmt.Sprintf("%v into the crash loop (lease TTL %v)", time.Since(started).Round(time.Second), ttl))
		n.startsWithoutAgent(t, ctx, "default", fmt.Sprintf("plain-%d", i))
		time.Sleep(ttl / 2)
	}
	ev := nodeEvent(t, ctx, "InvalidSetting")
	if !strings.Contains(ev.Message, "AMBIENTD_DNS_CAPTURE") {
		t.Errorf("node Event %s does not name the bad setting: %q", ev.Reason, ev.Message)
	}
	t.Logf("node Event: %s", ev.Message)
}

// TestPluginCredentialsConfined: the rights behind the plugin's
// credentials, on the real API server with deploy/rbac.yaml. The agent may
// mint tokens for the plugin's service account and for no other (not even
// one in its own namespace); a minted token may get a pod, a namespace and
// the agent's DaemonSet, and nothing else — no list, no write, no secret,
// no other DaemonSet.
func TestPluginCredentialsConfined(t *testing.T) {
	ctx := testutil.Context(t, 2*time.Minute)
	agent := testEnv.CP.Agent
	ns := e2eenv.AgentNamespace
	expiry := int64(600)
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}
	if err := testEnv.EnsureServiceAccount(ctx, ns, "default"); err != nil {
		t.Fatal(err)
	}
	if _, err := agent.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "default", req, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent minted a token for %s/default: %v; want Forbidden", ns, err)
	}
	tok, err := agent.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "ambientd-cni", req, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("the agent cannot mint the plugin's token: %v", err)
	}
	cfg := rest.AnonymousClientConfig(testEnv.CP.AgentConfig)
	cfg.BearerToken = tok.Status.Token
	plugin, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	p := createObjectOnly(t, ctx, "default", "plugin-reads")
	if _, err := plugin.CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{}); err != nil {
		t.Errorf("get pod: %v", err)
	}
	if _, err := plugin.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Errorf("get namespace: %v", err)
	}
	if _, err := plugin.AppsV1().DaemonSets(ns).Get(ctx, "ambientd", metav1.GetOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("get the agent's DaemonSet: %v; want an answer (NotFound is one)", err)
	}
	for what, call := range map[string]func() error{
		"list pods": func() error { _, err := plugin.CoreV1().Pods("").List(ctx, metav1.ListOptions{}); return err },
		"patch a pod": func() error {
			_, err := plugin.CoreV1().Pods("default").Patch(ctx, p.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
			return err
		},
		"get a secret": func() error { _, err := plugin.CoreV1().Secrets(ns).Get(ctx, "any", metav1.GetOptions{}); return err },
		"get another DaemonSet": func() error {
			_, err := plugin.AppsV1().DaemonSets(ns).Get(ctx, "other", metav1.GetOptions{})
			return err
		},
		"get a node": func() error {
			_, err := plugin.CoreV1().Nodes().Get(ctx, testEnv.NodeName, metav1.GetOptions{})
			return err
		},
		"mint a token in turn": func() error {
			_, err := plugin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, "ambientd-cni", req, metav1.CreateOptions{})
			return err
		},
	} {
		if err := call(); !apierrors.IsForbidden(err) {
			t.Errorf("the plugin's token could %s: %v; want Forbidden", what, err)
		}
	}
}
