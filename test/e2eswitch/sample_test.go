//go:build e2enode

package e2eswitch

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/ambientd/ambientd/podmeta"
	"github.com/ambientd/ambientd/test/infra/nodeenv"
)

// peer is a TCP server in the node's network namespace that says "peer" to
// every connection: a pod's outbound connection to it that reaches it went
// direct; one that ztunnel's outbound listener (the emulator's 15001) took
// says "ztunnel-emulator ..."; one that fails was black-holed (redirected
// to a port nothing listens on) or dropped.
type peer struct {
	ln   net.Listener
	Addr string
}

func startPeer(t *testing.T) *peer {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(node.IP.String(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	p := &peer{ln: ln, Addr: ln.Addr().String()}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.SetWriteDeadline(time.Now().Add(2 * time.Second))
			fmt.Fprintln(c, "peer")
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return p
}

// How a sample went.
const (
	captured = "captured" // ztunnel's outbound listener took it
	direct   = "direct"   // it reached the peer past the capture
	failed   = "failed"   // neither (black hole, drop, error)
)

type sample struct {
	at     time.Time
	result string
	detail string
}

// sampler dials the peer from inside one pod's network namespace every
// 200 ms and records where each connection went.
type sampler struct {
	pod, netns, dst string
	mu              sync.Mutex
	samples         []sample
	stop            context.CancelFunc
	done            chan struct{}
}

func startSampler(ctx context.Context, pod, netnsPath, dst string) *sampler {
	ctx, cancel := context.WithCancel(ctx)
	s := &sampler{pod: pod, netns: netnsPath, dst: dst, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for {
			x := s.once(ctx)
			if ctx.Err() != nil {
				return // stopped mid-sample
			}
			s.mu.Lock()
			s.samples = append(s.samples, x)
			s.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

func (s *sampler) once(ctx context.Context) sample {
	at := time.Now()
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	c, err := nodeenv.DialFrom(ctx, s.netns, s.dst)
	if err != nil {
		return sample{at, failed, err.Error()}
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(c).ReadString('\n')
	line = strings.TrimSpace(line)
	switch {
	case strings.HasPrefix(line, "ztunnel-emulator"):
		return sample{at, captured, line}
	case line == "peer":
		return sample{at, direct, line}
	}
	return sample{at, failed, fmt.Sprintf("read %q: %v", line, err)}
}

// Stop ends the sampling and waits for the last sample.
func (s *sampler) Stop() {
	s.stop()
	<-s.done
}

// check reports every sample in [from, to) whose result is not want (zero
// to: until now).
func (s *sampler) check(want string, from, to time.Time) (n int, bad []sample) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, x := range s.samples {
		if x.at.Before(from) || (!to.IsZero() && !x.at.Before(to)) {
			continue
		}
		n++
		if x.result != want {
			bad = append(bad, x)
		}
	}
	return n, bad
}

// counts returns how many samples had each result.
func (s *sampler) counts() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string]int{}
	for _, x := range s.samples {
		out[x.result]++
	}
	return out
}

// annotationWatch records every change of the redirection annotation of the
// namespace's pods that takes a pod from `enabled` to anything else.
type annotationWatch struct {
	mu      sync.Mutex
	changes []string
	stop    chan struct{}
}

func watchAnnotations(t *testing.T, ns string) *annotationWatch {
	t.Helper()
	w := &annotationWatch{stop: make(chan struct{})}
	f := informers.NewSharedInformerFactoryWithOptions(node.Env.CP.Admin, 0, informers.WithNamespace(ns))
	inf := f.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(o, n any) {
			op, np := o.(*corev1.Pod), n.(*corev1.Pod)
			was, now := op.Annotations[podmeta.AnnotationRedirection], np.Annotations[podmeta.AnnotationRedirection]
			if was == podmeta.RedirectionEnabled && now != was {
				w.mu.Lock()
				w.changes = append(w.changes, fmt.Sprintf("%s %s: %s %q -> %q", time.Now().Format(time.RFC3339Nano), np.Name, podmeta.AnnotationRedirection, was, now))
				w.mu.Unlock()
			}
		},
	}); err != nil {
		t.Fatal(err)
	}
	f.Start(w.stop)
	t.Cleanup(func() { close(w.stop); f.Shutdown() })
	return w
}

// Changes returns the recorded changes of pods other than except.
func (w *annotationWatch) Changes(except ...string) []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []string
next:
	for _, c := range w.changes {
		for _, e := range except {
			if strings.Contains(c, " "+e+": ") {
				continue next
			}
		}
		out = append(out, c)
	}
	return out
}
