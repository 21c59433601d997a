package nodeenv

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// WriteStaticPod puts pod's manifest in the kubelet's static pod directory
// (written aside and renamed in, so the kubelet never reads half a file):
// the kubelet runs it as a static pod under its manifest hash and creates
// its mirror pod in the API, named <name>-<node>.
func (n *Node) WriteStaticPod(pod *corev1.Pod) error {
	pod = pod.DeepCopy()
	pod.APIVersion, pod.Kind = "v1", "Pod"
	b, err := yaml.Marshal(pod)
	if err != nil {
		return fmt.Errorf("static pod %s: %w", pod.Name, err)
	}
	tmp := filepath.Join(filepath.Dir(n.StaticPodDir), "."+pod.Name+".yaml")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("static pod %s: %w", pod.Name, err)
	}
	if err := os.Rename(tmp, n.staticPodFile(pod.Name)); err != nil {
		return fmt.Errorf("static pod %s: %w", pod.Name, err)
	}
	return nil
}

// RemoveStaticPod removes the manifest WriteStaticPod wrote: the kubelet
// stops the pod and deletes its mirror pod. A manifest not there is fine.
func (n *Node) RemoveStaticPod(name string) error {
	if err := os.Remove(n.staticPodFile(name)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("static pod %s: %w", name, err)
	}
	return nil
}

// MirrorPodName is the name of the mirror pod of static pod name.
func (n *Node) MirrorPodName(name string) string { return name + "-" + n.Name }

func (n *Node) staticPodFile(name string) string {
	return filepath.Join(n.StaticPodDir, name+".yaml")
}
