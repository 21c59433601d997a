//go:build e2enode

package e2enode

import (
	"context"
	"encoding/json"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambientd/ambientd/test/infra/nodeenv"
	"github.com/ambientd/ambientd/test/infra/ztunnelemu"
)

func (r *agentRun) waitEmu(t *testing.T, ctx context.Context, what string, cond func(ztunnelemu.State) bool) ztunnelemu.State {
	t.Helper()
	var st ztunnelemu.State
	if err := nodeenv.Poll(ctx, "emulator: "+what, 100*time.Millisecond, func(ctx context.Context) (bool, error) {
		st = ztunnelemu.State{}
		if err := r.em.State(ctx, &st); err != nil {
			return false, err
		}
		return cond(st), nil
	}); err != nil {
		t.Fatalf("%v; requests: %+v", err, st.Requests)
	}
	return st
}

// opsFor lists the ops (add, del, keep) ztunnel received for uid.
func opsFor(st ztunnelemu.State, uid string) []string {
	var ops []string
	for _, q := range st.Requests {
		if q.UID == uid {
			ops = append(ops, q.Op)
		}
	}
	return ops
}

// keptThroughTheRoll: after an agent roll (what), ztunnel holds both the pod
// enrolled before it (uid) and the one created during it, the first never got
// a Del, and its outbound connection still lands on ztunnel's 15001.
func (r *agentRun) keptThroughTheRoll(t *testing.T, ctx context.Context, what, uid, duringUID string) {
	t.Helper()
	st := r.waitEmu(t, ctx, "both pods held by ztunnel after "+what, func(s ztunnelemu.State) bool {
		_, a := s.Workload(uid)
		_, b := s.Workload(duringUID)
		return a && b
	})
	if ops := opsFor(st, uid); slices.Contains(ops, "del") {
		t.Errorf("the enrolled pod got a Del during %s: %v", what, ops)
	}
	w, _ := st.Workload(uid)
	dialFrom(t, ctx, netnsByInode(t, w.NetnsInode), netip.AddrPortFrom(node.IP, 9).String())
	r.waitEmu(t, ctx, "outbound connection of the enrolled pod after "+what, func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool { return a.UID == uid && a.Port == 15001 })
	})
}

// capturedBeforeStart checks that pod p never ran uncaptured: the agent had
// programmed the redirection in the netns its running sandbox has (found by
// the pod's IP) before its app container started — the agent's log line for
// that CNI ADD against the app's first log line, both by timestamp — and that
// now ztunnel holds the pod with that netns and its outbound traffic lands
// on ztunnel's 15001. It returns ztunnel's Add.
func (r *agentRun) capturedBeforeStart(t *testing.T, ctx context.Context, p *corev1.Pod) ztunnelemu.RequestRecord {
	t.Helper()
	netnsPath, started, rulesAt, outcome := startedCaptured(t, ctx, p)
	ino := inode(t, netnsPath)
	uid := string(p.UID)
	st := r.waitEmu(t, ctx, "workload "+p.Name+" with netns inode "+strconv.FormatUint(ino, 10), func(s ztunnelemu.State) bool {
		w, ok := s.Workload(uid)
		return ok && w.NetnsInode == ino
	})
	var add ztunnelemu.RequestRecord
	for _, q := range st.Requests {
		if q.UID == uid && q.Op == "add" && q.NetnsInode == ino && q.AckError == "" {
			add = q
			break
		}
	}
	if add.At.IsZero() {
		t.Fatalf("pod %s: no acked Add with netns inode %d: %v", p.Name, ino, opsFor(st, uid))
	}
	dst := netip.AddrPortFrom(node.IP, 9).String()
	dialFrom(t, ctx, netnsPath, dst)
	r.waitEmu(t, ctx, "outbound connection of "+p.Name+" on 15001", func(s ztunnelemu.State) bool {
		return slices.ContainsFunc(s.Accepted, func(a ztunnelemu.AcceptRecord) bool {
			return a.UID == uid && a.Port == 15001 && a.OrigDst == dst && a.At.After(add.At)
		})
	})
	t.Logf("pod %s: CNI ADD answered (%s, rules in netns inode %d) %s before its app started; ztunnel's Add %s after the app started",
		p.Name, outcome, ino, started.Sub(rulesAt).Round(time.Millisecond), add.At.Sub(started).Round(time.Millisecond))
	return add
}

// startedCaptured checks that pod p's app started only after the agent had
// answered the CNI ADD that programmed the redirection in the netns its
// running sandbox has (found by the pod's IP): the agent's log line for that
// ADD against the app's first log line, both by timestamp. It returns that
// netns, when the app started, when the ADD was answered and its outcome.
func startedCaptured(t *testing.T, ctx context.Context, p *corev1.Pod) (netnsPath string, started, rulesAt time.Time, outcome string) {
	t.Helper()
	netnsPath, err := node.PodNetns(netip.MustParseAddr(p.Status.PodIP))
	if err != nil {
		t.Fatal(err)
	}
	started = appStartedAt(t, ctx, p.Namespace, p.Name)
	rulesAt, outcome = ruledAt(t, ctx, string(p.UID), netnsPath)
	if !rulesAt.Before(started) {
		t.Errorf("pod %s/%s: its app started at %s, before the agent answered the CNI ADD for its netns %s (%s at %s): it ran uncaptured",
			p.Namespace, p.Name, started.Format(time.RFC3339Nano), netnsPath, outcome, rulesAt.Format(time.RFC3339Nano))
	}
	return netnsPath, started, rulesAt, outcome
}

// ruledAt finds in the agent's log (JSON lines) the CNI ADD that enrolled
// pod uid with the netns at netnsPath ("enrolling new pod"), and returns when
// the agent answered it ("CNI ADD handled": its rules were in place then)
// and the outcome it answered.
func ruledAt(t *testing.T, ctx context.Context, uid, netnsPath string) (time.Time, string) {
	t.Helper()
	logs, err := node.Kubectl(ctx, "logs", "-n", "istio-system", "daemonset/ambientd")
	if err != nil {
		t.Fatal(err)
	}
	at, outcome, ok := ruledAtIn(logs, uid, netnsPath)
	if !ok {
		t.Fatalf("agent log: no answered CNI ADD enrolling pod %s with netns %s:\n%s", uid, netnsPath, logs)
	}
	return at, outcome
}

// ruledAtIn is ruledAt over agent logs already read (one agent's or
// several agents' in turn).
func ruledAtIn(logs, uid, netnsPath string) (time.Time, string, bool) {
	var rec struct {
		Time    time.Time `json:"time"`
		Msg     string    `json:"msg"`
		UID     string    `json:"uid"`
		Netns   string    `json:"netns"`
		Outcome string    `json:"outcome"`
	}
	enrolling := false
	for _, line := range strings.Split(logs, "\n") {
		rec.Msg, rec.UID, rec.Netns, rec.Outcome = "", "", "", ""
		if json.Unmarshal([]byte(line), &rec) != nil || rec.UID != uid {
			continue
		}
		switch {
		case rec.Msg == "enrolling new pod":
			enrolling = rec.Netns == netnsPath
		case rec.Msg == "CNI ADD handled" && enrolling:
			return rec.Time, rec.Outcome, true
		}
	}
	return time.Time{}, "", false
}
