package nodeenv

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// AppContainer is a container of AppImage with an HTTP readiness probe on
// /healthz, probed every second, never pulled.
func AppContainer() corev1.Container {
	return corev1.Container{
		Name:            "app",
		Image:           AppImage,
		ImagePullPolicy: corev1.PullNever,
		Ports:           []corev1.ContainerPort{{Name: "http", ContainerPort: AppPort}},
		ReadinessProbe: &corev1.Probe{
			ProbeHandler: corev1.ProbeHandler{
				HTTPGet: &corev1.HTTPGetAction{Path: "/healthz", Port: intstr.FromInt32(AppPort)},
			},
			PeriodSeconds:    1,
			FailureThreshold: 3,
		},
	}
}

// State is what pods leave on the node: compare the State before a pod was
// created with the one after it was deleted to find leftovers.
type State struct {
	Netns      []string // pod network namespaces (files in NetnsDir)
	Veths      []string // ports of the bridge
	Leases     []string // host-local's leased addresses
	Tasks      []string // running containerd tasks in the CRI namespace (sandboxes included)
	Shims      int      // containerd-shim processes of this node's containerd
	PodCgroups []string // kubelet's pod cgroups (cpu hierarchy)
}

func (s State) String() string {
	return fmt.Sprintf("netns %v, bridge ports %v, leases %v, running tasks %v, shims %d, pod cgroups %v",
		s.Netns, s.Veths, s.Leases, s.Tasks, s.Shims, s.PodCgroups)
}

// Diff names the kinds of things that differ between s and o (none when
// they list the same things).
func (s State) Diff(o State) []string {
	var d []string
	for _, c := range []struct {
		name string
		same bool
	}{
		{"netns", slices.Equal(s.Netns, o.Netns)},
		{"bridge ports", slices.Equal(s.Veths, o.Veths)},
		{"leases", slices.Equal(s.Leases, o.Leases)},
		{"tasks", slices.Equal(s.Tasks, o.Tasks)},
		{"shims", s.Shims == o.Shims},
		{"pod cgroups", slices.Equal(s.PodCgroups, o.PodCgroups)},
	} {
		if !c.same {
			d = append(d, c.name)
		}
	}
	return d
}

// State reads the node's current State.
func (n *Node) State(ctx context.Context) (State, error) {
	var s State
	var err error
	if s.Netns, err = dirNames(n.NetnsDir, nil); err != nil {
		return s, err
	}
	if s.Veths, err = dirNames(filepath.Join("/sys/class/net", n.Bridge, "brif"), nil); err != nil {
		return s, err
	}
	if s.Leases, err = dirNames(filepath.Join(n.IPAMDir, "ambientd-node"), func(name string) bool {
		return name != "lock" && !strings.HasPrefix(name, "last_reserved_ip")
	}); err != nil {
		return s, err
	}
	// Running tasks, not containers: kubelet removes the stopped containers
	// of a deleted pod only in its garbage collection, once a minute.
	out, err := exec.CommandContext(ctx, n.Bins.Ctr, "--address", n.ContainerdAddress, "--namespace", "k8s.io", "tasks", "list").Output()
	if err != nil {
		return s, fmt.Errorf("ctr tasks list: %w", err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[2] == "RUNNING" {
			s.Tasks = append(s.Tasks, f[0])
		}
	}
	slices.Sort(s.Tasks)
	s.Shims = len(shimPids(n.ContainerdAddress))
	for _, m := range n.cgroups {
		if m.FSType == "cgroup" && hasOption(m.Options, "cpu") {
			kp := filepath.Join(m.Dir, n.cgroupRoot, "kubepods")
			for _, d := range []string{kp, filepath.Join(kp, "besteffort"), filepath.Join(kp, "burstable")} {
				names, err := dirNames(d, func(name string) bool { return strings.HasPrefix(name, "pod") })
				if err != nil {
					return s, err
				}
				s.PodCgroups = append(s.PodCgroups, names...)
			}
		}
	}
	slices.Sort(s.PodCgroups)
	return s, nil
}

// dirNames lists the sorted names in dir that keep accepts (all when nil); a
// missing dir is empty.
func dirNames(dir string, keep func(string) bool) ([]string, error) {
	entries, err := os.ReadDir(dir)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range entries {
		if keep == nil || keep(e.Name()) {
			names = append(names, e.Name())
		}
	}
	return names, nil
}

// RestoredAtCleanup reads the node's State now and, when t ends (after the
// cleanups registered later: the test's pods, agents and namespaces go
// first, some of them asynchronously), waits up to three minutes for the
// node to be back to it, failing t with both states if it is not. what
// names the tests, for the message.
func (n *Node) RestoredAtCleanup(t testing.TB, ctx context.Context, what string) {
	t.Helper()
	before, err := n.State(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		var now State
		if err := Poll(ctx, "node back to its state before "+what, 500*time.Millisecond, func(ctx context.Context) (bool, error) {
			var err error
			now, err = n.State(ctx)
			return err == nil && len(now.Diff(before)) == 0, err
		}); err != nil {
			t.Errorf("%v\nbefore: %s\nnow:    %s", err, before, now)
		}
	})
}
