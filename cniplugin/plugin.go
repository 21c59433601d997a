// Package cniplugin is the logic of bin/ambientd-cni, the chained CNI plugin
// that hands pod sandbox events to the ambientd agent. It must stay light: it
// is exec'd for every pod, so it imports only the CNI libraries, gRPC and
// cniapi on the path where the agent answers; while none does, it reads the
// pod from the API (kubeapi: client-go's loader and transport only) and
// applies the agent's policy (package policy).
package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ambientd/ambientd/cniapi"
)

// About is printed by skel when the plugin runs without CNI_COMMAND.
const About = "ambientd-cni: chained CNI plugin that enrolls pods into the ambient mesh via the ambientd agent"

// SupportedVersions are the CNI spec versions the plugin speaks: those with
// prevResult (chaining), up to 1.1.0 (STATUS and GC).
var SupportedVersions = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// ErrAgentRefused is the CNI error code (plugin-specific range, >= 100) for
// an agent that answered but would not or could not enroll the pod.
const ErrAgentRefused uint = 100

// Plugin implements the CNI commands. Stdout is the CNI result channel;
// logs go to the configured logFile or Stderr, never Stdout.
type Plugin struct {
	Stdout io.Writer
	Stderr io.Writer
	// Started is when the process's Go code began (procinit.At); zero
	// when unknown. It only feeds the timings sent to the agent and logged.
	Started time.Time
}

// Funcs wires the plugin's commands for skel.PluginMainFuncs.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

// Add asks the agent to enroll the pod and returns prevResult unchanged.
// Non-Kubernetes calls and excluded namespaces pass through untouched.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	entered := time.Now()
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	log, closeLog := p.logger(conf)
	defer closeLog()
	log = log.With("cmd", "ADD", "container_id", args.ContainerID)

	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: missing prevResult",
			"ambientd-cni must run last in a plugin chain, after the plugins that create the pod interface and assign its IPs")
	}
	pod, ok, err := podIdentity(args.Args, args.ContainerID)
	if err != nil {
		log.Error("bad CNI_ARGS", "error", err)
		return err
	}
	if !ok {
		log.Debug("no Kubernetes pod in CNI_ARGS; passing through")
		return p.printPrev(conf)
	}
	log = log.With("namespace", pod.Namespace, "pod", pod.Name, "uid", pod.Uid)
	if conf.excluded(pod.Namespace) {
		log.Debug("namespace excluded; passing through")
		return p.printPrev(conf)
	}
	res, err := current.NewResultFromResult(conf.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, "ambientd-cni: cannot convert prevResult", err.Error())
	}
	pod.NetnsPath = args.Netns
	pod.Interface = args.IfName
	pod.Ips = podIPs(res)

	start := time.Now()
	timings := &cniapi.PluginTimings{ConfigNanos: int64(start.Sub(entered)), CallStartUnixNano: start.UnixNano()}
	if !p.Started.IsZero() {
		timings.InitNanos = int64(entered.Sub(p.Started))
	}
	ctx, cancel := context.WithTimeout(context.Background(), conf.timeout)
	defer cancel()
	var resp *cniapi.AddPodResponse
	err = callAgent(ctx, conf.AgentSocket, func(c cniapi.CNIEventsClient) (err error) {
		resp, err = c.AddPod(ctx, &cniapi.AddPodRequest{Pod: pod, Timings: timings})
		return err
	})
	if err != nil {
		cerr := agentError(ctx, err, conf.AgentSocket, conf.timeout, pod)
		log.Error("agent call failed", "error", cerr, "took", time.Since(start))
		// Only when nobody listens does the plugin decide without the
		// agent (never on the normal path: with an agent answering, the
		// plugin reads neither the lease nor the API).
		if errors.Is(err, errNoAgent) {
			pass, why := whileAbsent(context.Background(), filepath.Dir(conf.AgentSocket), pod, log)
			if pass {
				return p.printPrev(conf)
			}
			cerr.Details += "; decided without the agent: " + why
		}
		return cerr
	}
	if resp.GetOutcome() == cniapi.Outcome_OUTCOME_UNSPECIFIED {
		// Never pass a pod silently on an answer we cannot read.
		cerr := types.NewError(ErrAgentRefused, fmt.Sprintf("ambientd-cni: ambientd agent gave no outcome for pod %s/%s", pod.Namespace, pod.Name), resp.GetMessage())
		log.Error("agent answer without outcome", "error", cerr)
		return cerr
	}
	took := time.Since(start)
	err = p.printPrev(conf)
	// The breakdown of this process's ADD (docs/metrics.md, "CNI ADD
	// breakdown"): init and config as sent to the agent, the call (took)
	// and the agent's part of it, the result printed (reply), and since
	// the process's Go code began (total; exec and exit are the rest).
	attrs := []any{"outcome", resp.GetOutcome().String(), "message", resp.GetMessage(), "took", took,
		"init", time.Duration(timings.InitNanos), "config", time.Duration(timings.ConfigNanos),
		"agent", time.Duration(resp.GetAgentNanos()), "reply", time.Since(start) - took}
	if !p.Started.IsZero() {
		attrs = append(attrs, "total", time.Since(p.Started))
	}
	log.Info("agent answered", attrs...)
	return err
}

// Del tells the agent the sandbox is gone. It is best effort: a DEL that
// fails is retried by the runtime forever and blocks pod teardown, and the
// agent cleans up on its own from pod deletion events anyway.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		fmt.Fprintf(p.Stderr, "ambientd-cni: DEL with unusable config, not telling the agent: %v\n", err)
		return nil
	}
	log, closeLog := p.logger(conf)
	defer closeLog()
	log = log.With("cmd", "DEL", "container_id", args.ContainerID)

	pod, ok, err := podIdentity(args.Args, args.ContainerID)
	if err != nil || !ok {
		log.Debug("no usable Kubernetes pod in CNI_ARGS; nothing to tell the agent", "error", err)
		return nil
	}
	log = log.With("namespace", pod.Namespace, "pod", pod.Name, "uid", pod.Uid)
	if conf.excluded(pod.Namespace) {
		return nil
	}
	pod.NetnsPath = args.Netns
	pod.Interface = args.IfName
	if conf.PrevResult != nil {
		if res, err := current.NewResultFromResult(conf.PrevResult); err == nil {
			pod.Ips = podIPs(res)
		}
	}
	timeout := min(conf.timeout, maxDelTimeout)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err = callAgent(ctx, conf.AgentSocket, func(c cniapi.CNIEventsClient) error {
		_, err := c.DelPod(ctx, &cniapi.DelPodRequest{Pod: pod})
		return err
	})
	if err != nil {
		log.Warn("could not tell the agent; ignoring (DEL never fails)", "error", agentError(ctx, err, conf.AgentSocket, timeout, pod))
		return nil
	}
	log.Debug("agent told")
	return nil
}

// Check validates the config and that prevResult is present. It does not ask
// the agent: an agent restart must not turn healthy pods' CHECKs into
// failures, and the agent verifies and repairs enrolled pods' rules itself.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	conf, err := parseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: missing prevResult",
			"CHECK needs the result of the chain's earlier plugins")
	}
	if _, _, err := podIdentity(args.Args, args.ContainerID); err != nil {
		return err
	}
	return nil
}

// Status always reports ready, without asking the agent. The runtime turns a
// failing STATUS into NetworkReady=false, which makes the node NotReady: an
// agent restart must never do that to a node and every pod on it. Scheduling
// of ambient pods is gated by the node's cni.istio.io/not-ready taint, which
// the agent manages.
func (p *Plugin) Status(args *skel.CmdArgs) error {
	if _, err := parseConfig(args.StdinData); err != nil {
		return err
	}
	return nil
}

// GC succeeds without side effects: the plugin holds no per-attachment state
// and the agent reconciles its own from the Kubernetes API and /proc.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	if _, err := parseConfig(args.StdinData); err != nil {
		return err
	}
	return nil
}

func (p *Plugin) printPrev(conf *Config) error {
	res, err := conf.PrevResult.GetAsVersion(conf.CNIVersion)
	if err != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "ambientd-cni: cannot convert prevResult", err.Error())
	}
	return res.PrintTo(p.Stdout)
}

// podIPs returns the addresses on the pod's side: those whose interface is in
// a sandbox, or all of them when the result does not say which is where.
func podIPs(res *current.Result) []string {
	var ips []string
	for _, ip := range res.IPs {
		if ip.Interface != nil {
			i := *ip.Interface
			if i >= 0 && i < len(res.Interfaces) && res.Interfaces[i].Sandbox == "" {
				continue
			}
		}
		ips = append(ips, ip.Address.String())
	}
	return ips
}

// logger returns the plugin's logger and a func that closes its file. A log
// file that cannot be opened falls back to Stderr: logging problems must not
// fail pod networking.
func (p *Plugin) logger(conf *Config) (*slog.Logger, func()) {
	opts := &slog.HandlerOptions{Level: conf.logLevel}
	var w io.Writer = p.Stderr
	closeFn := func() {}
	var openErr error
	if conf.LogFile != "" {
		if err := os.MkdirAll(filepath.Dir(conf.LogFile), 0o755); err != nil {
			openErr = err
		} else if f, err := os.OpenFile(conf.LogFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600); err != nil {
			openErr = err
		} else {
			w = f
			closeFn = func() { f.Close() }
		}
	}
	if w == nil {
		w = io.Discard
	}
	log := slog.New(slog.NewTextHandler(w, opts)).With("component", cniapi.PluginType, "pid", os.Getpid())
	if openErr != nil {
		log.Warn("cannot open logFile; logging to stderr", "log_file", conf.LogFile, "error", openErr)
	}
	return log, closeFn
}

// agentError turns a failed call into a CNI error that says what failed.
func agentError(ctx context.Context, err error, socket string, timeout time.Duration, pod *cniapi.Pod) *types.Error {
	var cerr *types.Error
	if errors.As(err, &cerr) {
		return cerr
	}
	podName := pod.Namespace + "/" + pod.Name
	code, msg := statusOf(err)
	switch {
	case code == codeDeadlineExceeded || errors.Is(ctx.Err(), context.DeadlineExceeded):
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("ambientd-cni: timed out after %v waiting for the ambientd agent (pod %s)", timeout, podName),
			fmt.Sprintf("agent socket %s: %s", socket, msg))
	case code == codeUnavailable:
		return types.NewError(types.ErrTryAgainLater,
			fmt.Sprintf("ambientd-cni: ambientd agent unreachable at %s (pod %s)", socket, podName),
			msg)
	case code == codePermissionDenied:
		return types.NewError(ErrAgentRefused,
			fmt.Sprintf("ambientd-cni: ambientd agent refused the connection (pod %s)", podName), msg)
	default:
		return types.NewError(ErrAgentRefused,
			fmt.Sprintf("ambientd-cni: ambientd agent refused pod %s", podName),
			fmt.Sprintf("%s: %s", code, msg))
	}
}
