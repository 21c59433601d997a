package multusemu

// The plugin half of the double: Multus's thin plugin binary ("type":
// "multus"), as multus-cni v4.3.0-42-g95a093235 (commit 95a0932350f0)
// cmd/multus/main.go runs pkg/multus CmdAdd / CmdDel / CmdCheck. Followed
// from its source, not copied:
//
//   - the netconf is the runtime's stdin: "delegates" (each a config or a
//     conflist; the first is the master, the cluster network), "kubeconfig",
//     "binDir" (default /opt/cni/bin), "cniDir" (default
//     /var/lib/cni/multus), "logFile" (types.LoadNetConf);
//   - with a kubeconfig it reads the pod (GetPod: every 250 ms for 2.5 s;
//     not found → an empty result without running any delegate; a UID that
//     differs from K8S_POD_UID fails the ADD unless the pod is a static
//     pod's mirror); without one it never talks to the API;
//   - it saves the delegate list under cniDir/<container id> for DEL
//     (saveDelegates), then runs each delegate through libcni
//     (conflistAdd / confAdd) with binDirs = binDir + $CNI_PATH, libcni's
//     cache in cniDir, interface CNI_IFNAME for the master and "net<i>" for
//     the others (getIfname), and CNI args IgnoreUnknown=true,
//     K8S_POD_NAMESPACE, K8S_POD_NAME, K8S_POD_INFRA_CONTAINER_ID,
//     K8S_POD_UID, then the runtime's CNI_ARGS merged in
//     (CreateCNIRuntimeConf);
//   - a failing delegate deletes the ones added before it and fails the ADD
//     ("error adding container to network ...");
//   - it returns the master's result, converted to its own cniVersion;
//   - DEL runs the cached (else the configured, when the pod is known)
//     delegates in reverse order and removes the cache file; with neither it
//     succeeds without doing anything.
//
// Left out, because no test here uses them: NetworkAttachmentDefinitions
// and the pod's network-selection annotations (the pods of these tests
// have none, so Multus runs only its cluster network), the network-status
// annotation and Events it writes with its kubeconfig, clusterNetwork /
// defaultNetworks (thick mode's path), the readiness indicator file,
// gateway and MAC/IP requests, the interface-name check in the netns.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// Multus's defaults (pkg/types/conf.go).
const (
	DefaultBinDir = "/opt/cni/bin"
	DefaultCNIDir = "/var/lib/cni/multus"
)

// NetConf is the part of Multus's netconf the double reads.
type NetConf struct {
	CNIVersion     string            `json:"cniVersion"`
	Name           string            `json:"name"`
	Kubeconfig     string            `json:"kubeconfig"`
	BinDir         string            `json:"binDir"`
	CNIDir         string            `json:"cniDir"`
	LogFile        string            `json:"logFile"`
	ClusterNetwork string            `json:"clusterNetwork"`
	Delegates      []json.RawMessage `json:"delegates"`
}

func loadNetConf(b []byte) (*NetConf, error) {
	n := &NetConf{BinDir: DefaultBinDir, CNIDir: DefaultCNIDir}
	if err := json.Unmarshal(b, n); err != nil {
		return nil, fmt.Errorf("LoadNetConf: failed to load netconf: %w", err)
	}
	if n.ClusterNetwork != "" {
		return nil, errors.New("multus double: clusterNetwork (thick mode) is not reproduced; use delegates")
	}
	if len(n.Delegates) == 0 {
		return nil, errors.New("LoadNetConf: at least one delegate/clusterNetwork must be specified")
	}
	return n, nil
}

// k8sArgs are the Kubernetes CNI args Multus reads.
type k8sArgs struct{ namespace, name, infraID, uid string }

// parseK8sArgs reads CNI_ARGS with CNI's types.LoadArgs, as Multus does (a
// key it does not know fails unless IgnoreUnknown is set).
func parseK8sArgs(s string) (k8sArgs, error) {
	var raw struct {
		types.CommonArgs
		K8S_POD_NAMESPACE          types.UnmarshallableString
		K8S_POD_NAME               types.UnmarshallableString
		K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
		K8S_POD_UID                types.UnmarshallableString
	}
	if err := types.LoadArgs(s, &raw); err != nil {
		return k8sArgs{}, fmt.Errorf("LoadK8sArgs: %w", err)
	}
	return k8sArgs{string(raw.K8S_POD_NAMESPACE), string(raw.K8S_POD_NAME), string(raw.K8S_POD_INFRA_CONTAINER_ID), string(raw.K8S_POD_UID)}, nil
}

// Plugin is the multus binary's commands.
type Plugin struct{}

func (n *NetConf) logf(format string, args ...any) {
	if n.LogFile == "" {
		return
	}
	f, err := os.OpenFile(n.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, "%s "+format+"\n", append([]any{time.Now().Format(time.RFC3339Nano)}, args...)...)
}

func kubeClient(n *NetConf) (kubernetes.Interface, error) {
	if n.Kubeconfig == "" {
		return nil, nil // in-cluster config: never in these tests
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", n.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("GetK8sClient: failed to get context for the kubeconfig %v: %w", n.Kubeconfig, err)
	}
	cfg.Timeout = time.Minute
	return kubernetes.NewForConfig(cfg)
}

var errPodNotFound = errors.New("pod not found during Multus GetPod")

// getPod is Multus's GetPod without an informer: a GET every 250 ms for
// 2.5 s, then one more.
func getPod(c kubernetes.Interface, a k8sArgs, isDel bool) (found bool, err error) {
	if c == nil {
		return false, nil
	}
	deadline := time.Now().Add(2500 * time.Millisecond)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 250*time.Millisecond)
		p, err := c.CoreV1().Pods(a.namespace).Get(ctx, a.name, metav1.GetOptions{})
		cancel()
		switch {
		case apierrors.IsNotFound(err):
			return false, errPodNotFound
		case err == nil:
			_, mirror := p.Annotations["kubernetes.io/config.mirror"]
			if a.uid != "" && string(p.UID) != a.uid && !mirror {
				if isDel {
					return false, nil
				}
				return false, fmt.Errorf("expected pod UID %q but got %q from Kube API", a.uid, p.UID)
			}
			return true, nil
		case time.Now().After(deadline):
			return false, fmt.Errorf("error waiting for pod: %w", err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// runtimeConf is CreateCNIRuntimeConf: Multus's own args first, then the
// runtime's CNI_ARGS (filling empty values, adding the rest).
func runtimeConf(args *skel.CmdArgs, a k8sArgs, ifName string) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{
		ContainerID: args.ContainerID, NetNS: args.Netns, IfName: ifName,
		Args: [][2]string{
			{"IgnoreUnknown", "true"},
			{"K8S_POD_NAMESPACE", a.namespace},
			{"K8S_POD_NAME", a.name},
			{"K8S_POD_INFRA_CONTAINER_ID", a.infraID},
			{"K8S_POD_UID", a.uid},
		},
	}
	if args.Args == "" {
		return rt
	}
	for _, kv := range strings.Split(args.Args, ";") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		found := false
		for i := range rt.Args {
			if rt.Args[i][0] == k && rt.Args[i][1] == "" && v != "" {
				rt.Args[i][1], found = v, true
				break
			}
		}
		if !found {
			rt.Args = append(rt.Args, [2]string{k, v})
		}
	}
	return rt
}

func ifNameOf(argIf string, idx int) string {
	if idx == 0 {
		return argIf // the master always gets the runtime's interface
	}
	return fmt.Sprintf("net%d", idx)
}

func (n *NetConf) cni() *libcni.CNIConfig {
	dirs := append([]string{n.BinDir}, filepath.SplitList(os.Getenv("CNI_PATH"))...)
	return libcni.NewCNIConfigWithCacheDir(dirs, n.CNIDir, nil)
}

// delegate is one delegate's config: a conflist when it has "plugins".
func delegate(raw []byte) (list *libcni.NetworkConfigList, name string, err error) {
	var probe struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal(raw, &probe); err != nil {
		return nil, "", err
	}
	l, err := ConfList(raw)
	return l, probe.Name, err
}

// ConfList loads a CNI config as a runtime runs it: a conflist as it is, a
// single-plugin config (a .conf without "plugins") as a list of one, as
// libcni's runtimes and Multus's delegates treat it.
func ConfList(raw []byte) (*libcni.NetworkConfigList, error) {
	var conf map[string]json.RawMessage
	if err := json.Unmarshal(raw, &conf); err != nil {
		return nil, fmt.Errorf("decode CNI config: %w", err)
	}
	if _, ok := conf["plugins"]; ok {
		return libcni.NetworkConfFromBytes(raw)
	}
	list, err := json.Marshal(map[string]any{"cniVersion": conf["cniVersion"], "name": conf["name"], "plugins": []any{conf}})
	if err != nil {
		return nil, err
	}
	return libcni.NetworkConfFromBytes(list)
}

func cachePath(n *NetConf, containerID string) string { return filepath.Join(n.CNIDir, containerID) }

// Add is CmdAdd.
func (Plugin) Add(args *skel.CmdArgs) (types.Result, error) {
	n, err := loadNetConf(args.StdinData)
	if err != nil {
		return nil, err
	}
	c, err := kubeClient(n)
	if err != nil {
		return nil, fmt.Errorf("error getting k8s client: %w", err)
	}
	a, err := parseK8sArgs(args.Args)
	if err != nil {
		return nil, err
	}
	if _, err := getPod(c, a, false); err != nil {
		if errors.Is(err, errPodNotFound) {
			n.logf("ADD %s/%s: pod not found, empty result", a.namespace, a.name)
			return &current.Result{CNIVersion: n.CNIVersion, Interfaces: []*current.Interface{{Name: args.IfName, Sandbox: args.Netns}}}, nil
		}
		return nil, err
	}
	if err := os.MkdirAll(n.CNIDir, 0o755); err != nil {
		return nil, fmt.Errorf("saveDelegates: %w", err)
	}
	saved, _ := json.Marshal(n.Delegates)
	if err := os.WriteFile(cachePath(n, args.ContainerID), saved, 0o600); err != nil {
		return nil, fmt.Errorf("saveDelegates: error in saving the delegates: %w", err)
	}
	cni := n.cni()
	var master types.Result
	for idx, raw := range n.Delegates {
		list, name, err := delegate(raw)
		if err != nil {
			return nil, fmt.Errorf("delegate %d: %w", idx, err)
		}
		res, err := cni.AddNetworkList(context.Background(), list, runtimeConf(args, a, ifNameOf(args.IfName, idx)))
		if err != nil {
			n.del(args, a, n.Delegates[:idx+1])
			return nil, fmt.Errorf("[%s/%s/%s:%s]: error adding container to network %q: %w", a.namespace, a.name, a.uid, name, name, err)
		}
		if idx == 0 {
			master = res
		}
	}
	n.logf("ADD %s/%s %s: ran %d delegates", a.namespace, a.name, args.ContainerID, len(n.Delegates))
	return master.GetAsVersion(n.CNIVersion)
}

func (n *NetConf) del(args *skel.CmdArgs, a k8sArgs, delegates []json.RawMessage) error {
	cni := n.cni()
	var errs []error
	for idx := len(delegates) - 1; idx >= 0; idx-- {
		list, _, err := delegate(delegates[idx])
		if err == nil {
			err = cni.DelNetworkList(context.Background(), list, runtimeConf(args, a, ifNameOf(args.IfName, idx)))
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Del is CmdDel.
func (Plugin) Del(args *skel.CmdArgs) error {
	n, err := loadNetConf(args.StdinData)
	if err != nil {
		return err
	}
	c, err := kubeClient(n)
	if err != nil {
		return fmt.Errorf("error getting k8s client: %w", err)
	}
	a, err := parseK8sArgs(args.Args)
	if err != nil {
		return err
	}
	known, _ := getPod(c, a, true) // a failure is only logged by Multus
	delegates := n.Delegates
	b, err := os.ReadFile(cachePath(n, args.ContainerID))
	switch {
	case err == nil:
		if err := json.Unmarshal(b, &delegates); err != nil {
			delegates = n.Delegates
		}
	case errors.Is(err, os.ErrNotExist) && known:
	default:
		n.logf("DEL %s/%s %s: no cached delegates (%v), cannot properly delete", a.namespace, a.name, args.ContainerID, err)
		return nil
	}
	err = n.del(args, a, delegates)
	_ = os.Remove(cachePath(n, args.ContainerID))
	n.logf("DEL %s/%s %s: %d delegates (%v)", a.namespace, a.name, args.ContainerID, len(delegates), err)
	return err
}

// Check is CmdCheck: every delegate's CHECK.
func (Plugin) Check(args *skel.CmdArgs) error {
	n, err := loadNetConf(args.StdinData)
	if err != nil {
		return err
	}
	a, err := parseK8sArgs(args.Args)
	if err != nil {
		return err
	}
	cni := n.cni()
	for idx, raw := range n.Delegates {
		list, _, err := delegate(raw)
		if err == nil {
			err = cni.CheckNetworkList(context.Background(), list, runtimeConf(args, a, ifNameOf(args.IfName, idx)))
		}
		if err != nil {
			return err
		}
	}
	return nil
}
