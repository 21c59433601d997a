package ztunnel

import (
	"context"
	"log/slog"
	"sync"
)

// SubscribeSnapshotAcked returns a channel that receives a signal every time
// a ztunnel acks its SnapshotSent (signals coalesce if not drained), and a
// function that unsubscribes.
func (s *Server) SubscribeSnapshotAcked() (<-chan struct{}, func()) {
	return s.subscribe(s.subs)
}

// SubscribeStatus is like SubscribeSnapshotAcked, signalled on every change
// Status may show: a ztunnel connected (hello received) or gone, a snapshot
// acked. The node readiness condition follows it.
func (s *Server) SubscribeStatus() (<-chan struct{}, func()) {
	return s.subscribe(s.statusSubs)
}

func (s *Server) subscribe(m map[int]chan struct{}) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	id := s.subID
	s.subID++
	m[id] = ch
	s.mu.Unlock()
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			s.mu.Lock()
			delete(m, id)
			s.mu.Unlock()
		})
	}
}

// Status reports the connections and whether the newest acked its snapshot.
func (s *Server) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Status{Connections: len(s.conns)}
	if n := len(s.conns); n > 0 {
		st.SnapshotAcked = s.conns[n-1].snapshotAcked.Load()
	}
	for _, c := range s.conns {
		if c.snapshotAcked.Load() {
			st.Serving++
		}
	}
	st.Unresponsive = s.hung && st.Serving == 0
	return st
}

func (s *Server) newest() *zconn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.conns) == 0 {
		return nil
	}
	return s.conns[len(s.conns)-1]
}

// connsAfter returns the live connections whose id is above id, and the
// highest id handed out so far: a connection registered later has a higher id.
func (s *Server) connsAfter(id uint64) ([]*zconn, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*zconn
	for _, c := range s.conns {
		if c.id > id {
			out = append(out, c)
		}
	}
	return out, s.nextID
}

func (s *Server) register(c *zconn) {
	s.mu.Lock()
	s.nextID++
	c.id = s.nextID
	s.conns = append(s.conns, c)
	signal(s.statusSubs)
	s.mu.Unlock()
}

func (s *Server) unregister(c *zconn) {
	s.mu.Lock()
	if c.snapshotAcked.Load() {
		s.hung = c.unresponsive
	}
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			break
		}
	}
	signal(s.statusSubs)
	s.mu.Unlock()
}

func (s *Server) notifySnapshotAcked() {
	s.mu.Lock()
	defer s.mu.Unlock()
	signal(s.subs)
	signal(s.statusSubs)
}

// signal wakes every subscriber in m without blocking (callers hold s.mu).
func signal(m map[int]chan struct{}) {
	for _, ch := range m {
		select {
		case ch <- struct{}{}:
		default: // a signal is already pending
		}
	}
}

// readd asks the snapshot source to re-Add the pods a closed connection
// held to the now-newest connection, so a pod whose ztunnel went away (the
// newest one of a rolling update or a crash-looping one) is served by the
// one that remains instead of staying captured with nobody behind its
// redirect. The source sends the Adds (SnapshotSource.Readd); the server counts
// their results (ambientd_ztunnel_handovers_total). Nothing happens when no
// connection remains (a new ztunnel gets a snapshot) or the server is
// stopping.
func (s *Server) readd(ctx context.Context, log *slog.Logger, src SnapshotSource, held map[string]struct{}) {
	if len(held) == 0 || ctx.Err() != nil || s.newest() == nil {
		return
	}
	for uid := range held {
		src.Readd(uid, func(err error) {
			if err != nil {
				s.metrics.handovers.WithLabelValues("failed").Inc()
				log.Warn("re-adding pod to the remaining ztunnel failed", "uid", uid, "error", err)
				return
			}
			s.metrics.handovers.WithLabelValues("ok").Inc()
		})
	}
	log.Info("pods of the closed ztunnel queued for a re-add to the newest", "pods", len(held))
}
