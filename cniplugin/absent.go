package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/cniinstall"
	"github.com/ambientd/ambientd/cniplugin/kubeapi"
	"github.com/ambientd/ambientd/policy"
)

// absentBudget bounds the whole decision without an agent (lease, API
// reads, an uninstall's file work): an ADD that cannot decide in time
// fails closed and the runtime retries the sandbox.
const absentBudget = 2 * time.Second

// apiReader is what the plugin reads of the API while no agent answers
// (kubeapi.Client; a table of answers in tests).
type apiReader interface {
	Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	Namespace(ctx context.Context, name string) (*corev1.Namespace, error)
	DaemonSetGone(ctx context.Context, namespace, name string) (bool, error)
}

// absentDecision is what the plugin does with a pod while no agent answers.
type absentDecision struct {
	// pass: the pod starts (prevResult); otherwise the ADD fails closed.
	pass bool
	// uninstall: finish the uninstall the agent left before passing.
	uninstall bool
	// mesh: the agent's policy puts the pod in the mesh (ambient, or a
	// sidecar pod it captures); false also when unknown.
	mesh   bool
	reason string
}

// decideAbsent is the decision table of a pod's ADD while no agent listens
// on the socket (docs/install.md, "While no agent answers"): v is the
// install lease's verdict, api the API as the installer's credentials see
// it (nil, with apiErr, when they cannot be loaded). Only two proofs let a
// mesh pod through, and only by finishing the uninstall first: the lease
// says the agent decided to uninstall, or the API server says the agent's
// DaemonSet does not exist. A pod the agent's own policy keeps out of the
// mesh starts. Every other case, time included, fails closed.
func decideAbsent(ctx context.Context, v leaseVerdict, api apiReader, apiErr error, pod *cniapi.Pod) absentDecision {
	refuse := func(format string, args ...any) absentDecision {
		return absentDecision{reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case v.uninstalling:
		return absentDecision{pass: true, uninstall: true, reason: v.reason}
	case !v.usable:
		return refuse("%s", v.reason)
	case v.lease.Policy == nil:
		return refuse("the install lease holds no enrollment policy (written by an older agent): cannot tell whether the pod is in the mesh; waiting for the agent")
	case api == nil:
		return refuse("cannot read the API to decide without the agent (%v); waiting for the agent", apiErr)
	}
	p, err := api.Pod(ctx, pod.Namespace, pod.Name)
	if err != nil {
		return refuse("reading the pod from the API: %v; waiting for the agent", err)
	}
	if pod.Uid != "" && string(p.UID) != pod.Uid {
		return refuse("the API's pod %s/%s has uid %s, the sandbox's is %s; waiting for the agent", pod.Namespace, pod.Name, p.UID, pod.Uid)
	}
	ns, err := api.Namespace(ctx, pod.Namespace)
	if err != nil {
		return refuse("reading namespace %s from the API: %v; waiting for the agent", pod.Namespace, err)
	}
	pol := v.lease.Policy
	d := policy.Config{
		ExcludeNamespaces: pol.ExcludeNamespaces, SystemNamespace: pol.SystemNamespace,
		ZtunnelLabels: pol.ZtunnelLabels, SelfLabels: pol.SelfLabels,
	}.Decide(p, ns.Labels)
	if !d.InMesh && !(d.Sidecar && pol.Sidecar) {
		out := absentDecision{pass: true, reason: fmt.Sprintf("not in the mesh (%s): the pod starts without the agent", d.Reason)}
		// An agent away for longer than the lease's TTL may have been
		// uninstalled: ask, so that a node the agent left stops paying
		// this path on every pod. The pod starts whatever the answer.
		if v.awayLong && v.lease.DaemonSetName != "" {
			if gone, err := api.DaemonSetGone(ctx, v.lease.DaemonSetNamespace, v.lease.DaemonSetName); err == nil && gone {
				out.uninstall = true
				out.reason = fmt.Sprintf("%s; the API says DaemonSet %s/%s does not exist: the agent was uninstalled and nobody finished it", out.reason, v.lease.DaemonSetNamespace, v.lease.DaemonSetName)
			}
		}
		return out
	}
	mode := d.Mode()
	if v.lease.DaemonSetName == "" {
		return absentDecision{mesh: true, reason: fmt.Sprintf("in the mesh (%s, %s) and the install lease names no DaemonSet; waiting for the agent", mode, d.Reason)}
	}
	ds := v.lease.DaemonSetNamespace + "/" + v.lease.DaemonSetName
	gone, err := api.DaemonSetGone(ctx, v.lease.DaemonSetNamespace, v.lease.DaemonSetName)
	switch {
	case err != nil:
		return absentDecision{mesh: true, reason: fmt.Sprintf("in the mesh (%s, %s); reading DaemonSet %s: %v; waiting for the agent", mode, d.Reason, ds, err)}
	case gone:
		return absentDecision{pass: true, uninstall: true, mesh: true, reason: fmt.Sprintf("the API says DaemonSet %s does not exist: the agent was uninstalled and nobody finished it", ds)}
	}
	return absentDecision{mesh: true, reason: fmt.Sprintf("in the mesh (%s, %s) and DaemonSet %s exists: waiting for its agent", mode, d.Reason, ds)}
}

// whileAbsent is called when no agent listens on the socket. It decides
// with decideAbsent and, on an uninstall's proof, finishes the uninstall
// (our config entries, the binary, the lease) under a lock on the bin dir,
// so that the many ADDs of a node coming back do it once. It reports
// whether the pod goes through and why, and records what it did for the
// next agent in runDir, the agent's run dir (absence.go), unless it
// uninstalled.
func whileAbsent(ctx context.Context, runDir string, pod *cniapi.Pod, log *slog.Logger) (pass bool, why string) {
	if admitAbsent {
		log.Warn("known-bad build (ambientd_absent_admit): no agent on the socket; the pod starts whatever it is")
		return true, "known-bad build ambientd_absent_admit"
	}
	if refuseAbsent {
		log.Warn("known-bad build (ambientd_absent_refuse): no agent on the socket; the pod waits whatever it is")
		return false, "known-bad build ambientd_absent_refuse"
	}
	ctx, cancel := context.WithTimeout(ctx, absentBudget)
	defer cancel()
	exe, err := os.Executable()
	if err != nil {
		log.Error("cannot locate the plugin binary to read its install lease; waiting for the agent", "error", err)
		return false, "cannot locate the plugin binary: " + err.Error()
	}
	leasePath := exe + cniapi.LeaseSuffix
	v := judgeNow(leasePath)
	var api apiReader
	client, apiErr := kubeapi.Load(exe + cniapi.KubeconfigSuffix)
	if apiErr == nil {
		api = client
	}
	d := decideAbsent(ctx, v, api, apiErr, pod)
	defer func() {
		if !d.uninstall || !d.pass {
			recordAbsence(runDir, pod, d, v, log)
		}
	}()
	if !d.pass {
		log.Warn("no agent on the socket; the pod waits for it", "reason", d.reason, "path", leasePath)
		return false, d.reason
	}
	if !d.uninstall {
		log.Info("no agent on the socket; the pod starts", "reason", d.reason)
		return true, d.reason
	}
	unlock, err := lockDir(ctx, filepath.Dir(exe))
	if err != nil {
		log.Error("cannot lock the CNI bin dir to finish the uninstall; waiting for the agent", "error", err)
		d.pass, d.reason = false, "could not lock the bin dir to finish the uninstall: "+err.Error()
		return false, d.reason
	}
	defer unlock()
	// Again under the lock: another ADD may have finished it meanwhile.
	v = judgeNow(leasePath)
	if !v.usable {
		if _, err := os.Stat(leasePath); errors.Is(err, fs.ErrNotExist) {
			log.Info("another ADD finished the uninstall the agent left; passing the pod through", "path", leasePath)
			return true, "another ADD finished the uninstall"
		}
		log.Warn("no agent on the socket; waiting for it", "reason", v.reason, "path", leasePath)
		d.pass, d.reason = false, v.reason
		return false, d.reason
	}
	log = log.With("path", leasePath, "cni_conf_dir", v.lease.ConfDir)
	log.Warn("no agent on the socket and proof of an uninstall; finishing the uninstall and passing the pod through", "reason", d.reason)
	inst, err := cniinstall.FromLease(v.lease, exe, log.With("component", "cni-uninstall"))
	if err == nil {
		err = inst.FinishUninstall()
	}
	if err != nil {
		// The agent is gone for good either way: let the pod start, and
		// let the next ADD try the cleanup again.
		log.Error("could not finish the uninstall; passing the pod through, the next ADD tries again", "error", err)
		return true, d.reason
	}
	log.Warn("finished the uninstall the agent left: our CNI config entries, the plugin binary and the install lease are removed (host probe rules stay until the next install or `ambientd uninstall`)")
	return true, d.reason
}
