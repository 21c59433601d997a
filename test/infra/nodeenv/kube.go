package nodeenv

import (
	"path/filepath"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// kubeletPaths are the directories and files kubelet gets.
type kubeletPaths struct {
	RootDir, PodLogsDir, VolumePluginDir, ResolvConf string
	RuntimeEndpoint                                  string // unix://...
	// StaticPodPath is the kubelet's static pod directory (manifests it
	// runs as static pods, with mirror pods in the API).
	StaticPodPath string
}

// kubeletConfig renders the KubeletConfiguration for this kind of machine
// (docs/realnode.md): cgroup v1 allowed, the cgroupfs driver (containerd 1.6
// does not report one), a cgroup root of our own, no iptables chains on the
// node, anonymous AlwaysAllow serving (only the node netns can reach it),
// image GC and eviction thresholds that never fire on our imported images.
func kubeletConfig(p kubeletPaths, cgroupRoot string, port, healthzPort int, taints []corev1.Taint) ([]byte, error) {
	if taints == nil {
		taints = []corev1.Taint{}
	}
	return yaml.Marshal(map[string]any{
		"registerWithTaints":       taints,
		"apiVersion":               "kubelet.config.k8s.io/v1beta1",
		"kind":                     "KubeletConfiguration",
		"failCgroupV1":             false,
		"cgroupDriver":             "cgroupfs",
		"cgroupRoot":               "/" + cgroupRoot,
		"cgroupsPerQOS":            true,
		"containerRuntimeEndpoint": p.RuntimeEndpoint,
		"makeIPTablesUtilChains":   false,
		"address":                  "0.0.0.0",
		"port":                     port,
		"readOnlyPort":             0,
		"healthzBindAddress":       "127.0.0.1",
		"healthzPort":              healthzPort,
		"authentication": map[string]any{
			"anonymous": map[string]any{"enabled": true},
			"webhook":   map[string]any{"enabled": false},
		},
		"authorization":               map[string]any{"mode": "AlwaysAllow"},
		"failSwapOn":                  false,
		"podLogsDir":                  p.PodLogsDir,
		"volumePluginDir":             p.VolumePluginDir,
		"resolvConf":                  p.ResolvConf,
		"imageGCHighThresholdPercent": 100,
		"imageGCLowThresholdPercent":  99,
		"evictionHard": map[string]string{
			"memory.available":  "1Mi",
			"nodefs.available":  "1%",
			"imagefs.available": "1%",
		},
		"rotateCertificates":  false,
		"serializeImagePulls": false,
		"staticPodPath":       p.StaticPodPath,
		// The kubelet watches the directory (inotify); the periodic
		// re-read (default 20s) is only its fallback.
		"fileCheckFrequency": "1s",
	})
}

func kubeletArgs(configFile, kubeconfig, rootDir, nodeName, nodeIP string) []string {
	return []string{
		"--config=" + configFile,
		"--kubeconfig=" + kubeconfig,
		"--root-dir=" + rootDir,
		// Not derived from --root-dir.
		"--cert-dir=" + filepath.Join(rootDir, "pki"),
		"--hostname-override=" + nodeName,
		"--node-ip=" + nodeIP,
		"--v=2",
	}
}

// controllerManagerArgs runs every default controller (the DaemonSet and
// node lifecycle controllers are the ones the node needs) without leader
// election, serving /healthz on a loopback port, publishing the apiserver's
// CA as kube-root-ca.crt (projected service account volumes need it).
func controllerManagerArgs(kubeconfig, caFile, dir string, port int) []string {
	return append(controlPlaneArgs(kubeconfig, dir, port),
		"--flex-volume-plugin-dir="+filepath.Join(dir, "flexvolume"),
		"--root-ca-file="+caFile,
		"--use-service-account-credentials=false",
	)
}

func schedulerArgs(kubeconfig, dir string, port int) []string {
	return controlPlaneArgs(kubeconfig, dir, port)
}

// controlPlaneArgs are the flags kube-controller-manager and kube-scheduler
// share: one kubeconfig for the API and for delegated authn/authz, /healthz
// on a loopback port with a self-signed certificate in dir, no leader
// election.
func controlPlaneArgs(kubeconfig, dir string, port int) []string {
	return []string{
		"--kubeconfig=" + kubeconfig,
		"--authentication-kubeconfig=" + kubeconfig,
		"--authorization-kubeconfig=" + kubeconfig,
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--leader-elect=false",
		"--profiling=false",
		"--v=1",
	}
}
