package helm

import (
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"github.com/ambientd/ambientd/test/helm/chartrender"
)

// agentConfig is what a values file configures the node agent to do, read
// from a rendered chart: the host directories it works in, whom it
// enrolls and how it captures, the repair controller, and where and how
// the DaemonSet is scheduled.
type agentConfig struct {
	BinDir, ConfDir, NetnsDir string // host paths
	ConfFileName              string
	ExcludeNamespaces         []string
	DNSCapture, IPv6          string
	Nftables                  bool
	RepairMode                string
	RepairInitContainer       string
	RepairLabel               string // key=value, label mode only
	LogLevel                  string

	NodeSelector                  map[string]string
	Affinity                      *corev1.Affinity
	PriorityClassName             string
	TerminationGracePeriodSeconds int64
	UpdateStrategy                appsv1.DaemonSetUpdateStrategy
	ImagePullSecrets              []string
	ResourceQuotaPods             string // "" without the quota
	SELinux                       *corev1.SELinuxOptions
	Seccomp                       *corev1.SeccompProfile

	tolerations []corev1.Toleration
	resources   corev1.ResourceRequirements
	podLabels   map[string]string
	podAnnots   map[string]string
	dsLabels    map[string]string
	env         map[string]string
}

// chartObjects are the objects of one render by kind and name.
type chartObjects map[string]*unstructured.Unstructured

func (c chartObjects) get(t *testing.T, kind, name string, into any) bool {
	t.Helper()
	o, ok := c[kind+"/"+name]
	if !ok {
		return false
	}
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, into); err != nil {
		t.Fatalf("%s/%s: %v", kind, name, err)
	}
	return true
}

func objectsOf(t *testing.T, dir string, o chartrender.Options) chartObjects {
	t.Helper()
	rs, err := chartrender.Render(dir, o)
	if err != nil {
		t.Fatalf("render %s with %v: %v", dir, o.ValuesFiles, err)
	}
	objs, err := chartrender.Objects(rs)
	if err != nil {
		t.Fatal(err)
	}
	m := chartObjects{}
	for _, o := range objs {
		m[o.GetKind()+"/"+o.GetName()] = o
	}
	return m
}

// hostPathAt is the host path of the volume the container mounts at dir.
func hostPathAt(t *testing.T, ds *appsv1.DaemonSet, dir string) string {
	t.Helper()
	c := ds.Spec.Template.Spec.Containers[0]
	for _, m := range c.VolumeMounts {
		if m.MountPath != dir {
			continue
		}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == m.Name && v.HostPath != nil {
				return v.HostPath.Path
			}
		}
	}
	t.Fatalf("DaemonSet %s mounts no host path at %s", ds.Name, dir)
	return ""
}

func scheduling(c *agentConfig, ds *appsv1.DaemonSet, objs chartObjects, t *testing.T, sa, quota string) {
	p := ds.Spec.Template.Spec
	c.NodeSelector = p.NodeSelector
	c.Affinity = p.Affinity
	c.PriorityClassName = p.PriorityClassName
	if p.TerminationGracePeriodSeconds != nil {
		c.TerminationGracePeriodSeconds = *p.TerminationGracePeriodSeconds
	}
	c.UpdateStrategy = ds.Spec.UpdateStrategy
	c.tolerations = p.Tolerations
	c.resources = p.Containers[0].Resources
	c.podLabels = ds.Spec.Template.Labels
	c.podAnnots = ds.Spec.Template.Annotations
	c.dsLabels = ds.Labels
	c.env = map[string]string{}
	for _, e := range p.Containers[0].Env {
		if e.ValueFrom == nil {
			c.env[e.Name] = e.Value
		}
	}
	if sc := p.Containers[0].SecurityContext; sc != nil {
		c.SELinux, c.Seccomp = sc.SELinuxOptions, sc.SeccompProfile
	}
	var account corev1.ServiceAccount
	if objs.get(t, "ServiceAccount", sa, &account) {
		for _, s := range account.ImagePullSecrets {
			c.ImagePullSecrets = append(c.ImagePullSecrets, s.Name)
		}
	}
	var q corev1.ResourceQuota
	if objs.get(t, "ResourceQuota", quota, &q) {
		pods := q.Spec.Hard[corev1.ResourcePods]
		c.ResourceQuotaPods = pods.String()
	}
}

// istioConfig reads Istio's rendered cni chart: its ConfigMap
// (istio-cni-config), DaemonSet (istio-cni-node) and ServiceAccount.
func istioConfig(t *testing.T, objs chartObjects) agentConfig {
	t.Helper()
	var cm corev1.ConfigMap
	var ds appsv1.DaemonSet
	if !objs.get(t, "ConfigMap", "istio-cni-config", &cm) || !objs.get(t, "DaemonSet", "istio-cni-node", &ds) {
		t.Fatalf("Istio's chart rendered no istio-cni-config / istio-cni-node: %v", keys(objs))
	}
	d := cm.Data
	c := agentConfig{
		BinDir:            hostPathAt(t, &ds, "/host/opt/cni/bin"),
		ConfDir:           hostPathAt(t, &ds, "/host/etc/cni/net.d"),
		NetnsDir:          hostPathAt(t, &ds, "/host/var/run/netns"),
		ConfFileName:      d["CNI_CONF_NAME"],
		ExcludeNamespaces: strings.Split(d["EXCLUDE_NAMESPACES"], ","),
		DNSCapture:        d["AMBIENT_DNS_CAPTURE"],
		IPv6:              d["AMBIENT_IPV6"],
		Nftables:          d["NATIVE_NFTABLES"] == "true",
		LogLevel:          "info",
	}
	if d["AMBIENT_ENABLED"] != "true" {
		t.Fatalf("Istio's chart: AMBIENT_ENABLED=%q: not an ambient values file", d["AMBIENT_ENABLED"])
	}
	// Istio's repair controller (cni/pkg/repair/repaircontroller.go): repair
	// pods, else delete, else label.
	switch {
	case d["REPAIR_ENABLED"] != "true":
		c.RepairMode = "off"
	case d["REPAIR_REPAIR_PODS"] == "true":
		c.RepairMode = "repair"
	case d["REPAIR_DELETE_PODS"] == "true":
		c.RepairMode = "delete"
	case d["REPAIR_LABEL_PODS"] == "true":
		c.RepairMode = "label"
	default:
		c.RepairMode = "off"
	}
	c.RepairInitContainer = d["REPAIR_INIT_CONTAINER_NAME"]
	if c.RepairMode == "label" {
		c.RepairLabel = d["REPAIR_BROKEN_POD_LABEL_KEY"] + "=" + d["REPAIR_BROKEN_POD_LABEL_VALUE"]
	}
	for _, a := range ds.Spec.Template.Spec.Containers[0].Args {
		if l, ok := strings.CutPrefix(a, "--log_output_level="); ok {
			c.LogLevel = l
		}
	}
	scheduling(&c, &ds, objs, t, "istio-cni", "istio-cni-resource-quota")
	return c
}

// ambientdConfig reads our rendered chart the same way.
func ambientdConfig(t *testing.T, objs chartObjects) agentConfig {
	t.Helper()
	var cm corev1.ConfigMap
	var ds appsv1.DaemonSet
	if !objs.get(t, "ConfigMap", "ambientd-config", &cm) || !objs.get(t, "DaemonSet", "ambientd", &ds) {
		t.Fatalf("our chart rendered no ambientd-config / ambientd: %v", keys(objs))
	}
	d := cm.Data
	c := agentConfig{
		BinDir:              hostPathAt(t, &ds, "/host/opt/cni/bin"),
		ConfDir:             hostPathAt(t, &ds, "/host/etc/cni/net.d"),
		NetnsDir:            hostPathAt(t, &ds, "/var/run/netns"),
		ConfFileName:        d["AMBIENTD_CNI_CONF_NAME"],
		ExcludeNamespaces:   strings.Split(d["AMBIENTD_EXCLUDE_NAMESPACES"], ","),
		DNSCapture:          d["AMBIENTD_DNS_CAPTURE"],
		IPv6:                d["AMBIENTD_IPV6"],
		Nftables:            d["AMBIENTD_IPTABLES"] == "nftables",
		RepairMode:          d["AMBIENTD_REPAIR_MODE"],
		RepairInitContainer: d["AMBIENTD_REPAIR_INIT_CONTAINER_NAME"],
		LogLevel:            d["AMBIENTD_LOG_LEVEL"],
	}
	if c.RepairInitContainer == "" {
		c.RepairInitContainer = "istio-validation" // the agent's default (--repair-init-container-name)
	}
	if c.RepairMode == "label" {
		c.RepairLabel = d["AMBIENTD_REPAIR_LABEL_KEY"] + "=" + d["AMBIENTD_REPAIR_LABEL_VALUE"]
	}
	scheduling(&c, &ds, objs, t, "ambientd", "ambientd-resource-quota")
	return c
}

// Compatibility is proven against Istio's own chart: Istio's `cni` chart,
// from the Istio release the oracle module (test/istio-oracle) pins,
// rendered with each real-world values file, and ours rendered with the
// same file, configure the agent to the same effect: the same host
// directories, exclusions, capture settings, repair mode, log level and
// scheduling (node selector, affinity, priority, tolerations, resources,
// update strategy, pod labels and annotations, pull secrets, quota).
// Where the values file leaves a setting to the chart's default and
// ambientd's default differs on purpose (tolerations, resources), ours must
// tolerate at least what Istio's tolerates.
func TestSameValuesConfigureTheAgentLikeIstiosChart(t *testing.T) {
	istio, err := chartrender.IstioModuleDir("../istio-oracle")
	if err != nil {
		t.Fatal(err)
	}
	istioChart := filepath.Join(istio, "manifests", "charts", "istio-cni")
	for _, f := range valuesFiles(t) {
		t.Run(strings.TrimSuffix(filepath.Base(f), ".yaml"), func(t *testing.T) {
			kube := "v1.36.0"
			if strings.Contains(f, "gke") {
				kube = "v1.36.0-gke.1200000" // what GKE's API server reports
			}
			o := chartrender.Options{Namespace: "istio-system", KubeVersion: kube, ValuesFiles: []string{f}}
			o.Release = "istio-cni"
			want := istioConfig(t, objectsOf(t, istioChart, o))
			o.Release = "ambientd"
			got := ambientdConfig(t, objectsOf(t, chartDir, o))

			user, err := chartrender.Values([]string{f}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if cni, ok := user["cni"].(map[string]any); ok {
				for k, v := range cni {
					user[k] = v
				}
			}
			if !reflect.DeepEqual(got.agentConfigComparable(), want.agentConfigComparable()) {
				g, _ := yaml.Marshal(got.agentConfigComparable())
				w, _ := yaml.Marshal(want.agentConfigComparable())
				t.Errorf("%s configures ambientd:\n%s\nand Istio's agent:\n%s", f, g, w)
			}
			if _, set := user["tolerations"]; set {
				if !reflect.DeepEqual(got.tolerations, want.tolerations) {
					t.Errorf("tolerations: ours %v, Istio's %v", got.tolerations, want.tolerations)
				}
			} else {
				for _, taint := range sampleTaints {
					if tolerates(want.tolerations, taint) && !tolerates(got.tolerations, taint) {
						t.Errorf("Istio's agent tolerates taint %v, ours does not", taint)
					}
				}
			}
			if _, set := user["resources"]; set {
				if !reflect.DeepEqual(got.resources.Requests, want.resources.Requests) || !reflect.DeepEqual(got.resources.Limits, want.resources.Limits) {
					t.Errorf("resources: ours %v, Istio's %v", got.resources, want.resources)
				}
			}
			for name, labels := range map[string][2]map[string]string{
				"podLabels":       {got.podLabels, want.podLabels},
				"podAnnotations":  {got.podAnnots, want.podAnnots},
				"daemonSetLabels": {got.dsLabels, want.dsLabels},
			} {
				given, _ := user[name].(map[string]any)
				for k := range given {
					if labels[0][k] != labels[1][k] {
						t.Errorf("%s %s: ours %q, Istio's %q", name, k, labels[0][k], labels[1][k])
					}
				}
			}
			for k, v := range want.env {
				if given, _ := user["env"].(map[string]any); given[k] != nil && got.env[k] != v {
					t.Errorf("env %s: ours %q, Istio's %q", k, got.env[k], v)
				}
			}
		})
	}
}

// agentConfigComparable is the part compared field for field.
func (c agentConfig) agentConfigComparable() agentConfig {
	c.tolerations, c.resources, c.podLabels, c.podAnnots, c.dsLabels, c.env = nil, corev1.ResourceRequirements{}, nil, nil, nil, nil
	slices.Sort(c.ExcludeNamespaces)
	return c
}

// sampleTaints are taints a node agent's DaemonSet meets: the startup
// taint, critical add-on and dedicated-pool taints, and NoExecute ones of
// node problems.
var sampleTaints = []corev1.Taint{
	{Key: "cni.istio.io/not-ready", Effect: corev1.TaintEffectNoSchedule},
	{Key: "CriticalAddonsOnly", Value: "true", Effect: corev1.TaintEffectNoSchedule},
	{Key: "dedicated", Value: "mesh", Effect: corev1.TaintEffectNoSchedule},
	{Key: "node.kubernetes.io/not-ready", Effect: corev1.TaintEffectNoExecute},
	{Key: "node.kubernetes.io/unreachable", Effect: corev1.TaintEffectNoExecute},
	{Key: "node.kubernetes.io/disk-pressure", Effect: corev1.TaintEffectNoSchedule},
}

func tolerates(ts []corev1.Toleration, taint corev1.Taint) bool {
	for _, tol := range ts {
		if tol.ToleratesTaint(klog.Background(), &taint, false) {
			return true
		}
	}
	return false
}

// On OpenShift the runtime (CRI-O, as the machine-config operator
// configures it: `crio-status config` on an OpenShift 4 node shows
// network_dir /etc/kubernetes/cni/net.d/, plugin_dirs /var/lib/cni/bin
// first) reads /etc/kubernetes/cni/net.d, where Multus's 00-multus.conf
// sorts first. Istio's platform-openshift profile
// (manifests/helm-profiles/platform-openshift.yaml) installs a standalone
// istio-cni.conf into /etc/cni/multus/net.d instead — a dir the runtime
// does not read, which Multus runs only for pods naming an istio-cni
// NetworkAttachmentDefinition. ambientd always chains into the config the
// runtime uses, so its preset points at CRI-O's dir, where the installer
// inserts its entry after Multus's (cniinstall's meta-plugin rule), and
// no file name is forced.
func TestOpenShiftPresetChainsWhereCRIOReads(t *testing.T) {
	for _, set := range [][]string{{"global.platform=openshift"}, {"platform=openshift", "profile=ambient"}} {
		objs := objectsOf(t, chartDir, chartrender.Options{Release: "ambientd", Namespace: "istio-system", KubeVersion: "v1.36.0", Set: set})
		c := ambientdConfig(t, objs)
		if c.ConfDir != "/etc/kubernetes/cni/net.d" || c.BinDir != "/var/lib/cni/bin" || c.ConfFileName != "" {
			t.Errorf("%v: conf dir %q, bin dir %q, conf name %q; want CRI-O's /etc/kubernetes/cni/net.d and /var/lib/cni/bin, no name forced", set, c.ConfDir, c.BinDir, c.ConfFileName)
		}
		var ds appsv1.DaemonSet
		objs.get(t, "DaemonSet", "ambientd", &ds)
		sc := ds.Spec.Template.Spec.Containers[0].SecurityContext
		if sc == nil || sc.SELinuxOptions == nil || sc.SELinuxOptions.Type != "spc_t" {
			t.Errorf("%v: the agent's SELinux type is not spc_t (OpenShift's for privileged node agents): %+v", set, sc)
		}
	}
}
