// Package ztunnelemu is a ztunnel emulator for tests and the demo. It speaks
// the ZDS protocol exactly as real ztunnel 1.24+ does from the client side:
// it connects (with backoff), says hello, builds its workload set from the
// snapshot, drops what the snapshot did not mention, acks every request in
// order, and treats the violations real ztunnel exits on as protocol errors.
// In netns mode it also enters every workload's network namespace and listens
// on ztunnel's ports there, recording each connection it accepts.
//
// Follows: ztunnel 1.24+, the node-agent client of istio/ztunnel's
// src/inpod/ (workloadmanager.rs: connect with backoff, hello;
// statemanager.rs: the snapshot and SnapshotSent; protocol.rs: one ack per
// request), over ztunnelproto's zds.proto, which is ztunnel's field for field
// (docs/ztunnel.md).
//
// Does not emulate: carrying traffic — an accepted connection on 15001,
// 15006 or 15008 is answered with one line and closed (no HBONE, no mTLS,
// no forwarding, no authorization policy, no DNS proxy on 15053); xDS, the
// CA and anything else ztunnel learns from the control plane (it knows a
// workload only by what ZDS carries); ztunnel's admin, metrics and readiness
// ports (15000, 15020, 15021); ztunnel's own pod (it is a process the tests
// start and stop, or a goroutine in unit tests).
package ztunnelemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	zp "github.com/ambientd/ambientd/ztunnelproto"
)

// ErrProtocolExit is returned by Run when ExitOnProtocolError is set and the
// agent violated the protocol.
var ErrProtocolExit = errors.New("ztunnel emulator: exiting on protocol error")

// Config configures an Emulator; zero fields take the defaults in brackets.
type Config struct {
	SocketPath string // [zp.DefaultSocketPath]
	// NetnsMode enters each workload's netns and listens on Ports there.
	NetnsMode bool
	// ExitOnProtocolError makes Run return ErrProtocolExit on the first
	// violation, as real ztunnel exits. Otherwise the emulator closes the
	// connection, as ztunnel's exit would, and reconnects.
	ExitOnProtocolError bool
	// Nacks: workload key (uid or namespace/name) → error to answer Adds with.
	Nacks        map[string]string
	ReconnectMin time.Duration // [50ms]
	ReconnectMax time.Duration // [2s]
	Ports        []int         // [15001, 15006, 15008]
	Mark         int           // SO_MARK of the listeners [0x539]
	MaxRecords   int           // cap of each record list, oldest dropped [100000]
}

// Emulator is one emulated ztunnel. Use New, then Run.
type Emulator struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	changed   chan struct{} // closed and replaced on every state change
	hang      chan struct{} // closed by Hang
	hangOnce  sync.Once
	workloads map[string]*workload
	nacks     map[string]string
	conns     []ConnRecord
	current   *zp.Conn // live connection, for Disconnect
	currentID int
	requests  []RequestRecord
	accepted  []AcceptRecord
	protoErrs []ProtocolError

	lwg sync.WaitGroup // accept loops
}

type workload struct {
	info      Workload
	netns     *os.File
	dev, ino  uint64
	listeners []*listener
	dns       []net.PacketConn // netns mode: ztunnel's DNS port (UDP)
}

// New returns an emulator; nothing happens until Run.
func New(cfg Config, log *slog.Logger) *Emulator {
	if cfg.SocketPath == "" {
		cfg.SocketPath = zp.DefaultSocketPath
	}
	if cfg.ReconnectMin <= 0 {
		cfg.ReconnectMin = 50 * time.Millisecond
	}
	if cfg.ReconnectMax <= 0 {
		cfg.ReconnectMax = 2 * time.Second
	}
	if len(cfg.Ports) == 0 {
		cfg.Ports = []int{zp.OutboundPort, zp.InboundPort, zp.HBONEPort}
	}
	if cfg.Mark == 0 {
		cfg.Mark = zp.ProxyMark
	}
	if cfg.MaxRecords <= 0 {
		cfg.MaxRecords = 100000
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Emulator{
		cfg:       cfg,
		log:       log.With("component", "ztunnel-emulator"),
		changed:   make(chan struct{}),
		hang:      make(chan struct{}),
		workloads: map[string]*workload{},
		nacks:     map[string]string{},
	}
	maps.Copy(e.nacks, cfg.Nacks)
	return e
}

// Run connects to the agent and serves connections, reconnecting with
// backoff, until ctx is done (returns nil) or, with ExitOnProtocolError, the
// agent violates the protocol. On return every workload is dropped: its
// listeners and netns are closed.
func (e *Emulator) Run(ctx context.Context) error {
	defer e.dropAll()
	backoff := e.cfg.ReconnectMin
	for {
		c, err := zp.Dial(ctx, e.cfg.SocketPath)
		if err == nil {
			backoff = e.cfg.ReconnectMin
			err = e.session(ctx, c)
			if errors.Is(err, ErrProtocolExit) && e.cfg.ExitOnProtocolError {
				return err
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		e.log.Debug("reconnecting", "in", backoff, "err", err)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(backoff*2, e.cfg.ReconnectMax)
	}
}

// session serves one connection until it ends.
func (e *Emulator) session(ctx context.Context, c *zp.Conn) error {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if err := c.Send(zp.HelloV1(), nil, time.Now().Add(5*time.Second)); err != nil {
		return fmt.Errorf("send hello: %w", err)
	}
	id := e.connOpened(c)
	defer e.connClosed(id)
	log := e.log.With("conn", id)
	log.Info("connected to agent", "socket", e.cfg.SocketPath)

	s := &sessionState{id: id, snapshot: map[string]bool{}}
	for {
		req, files, err := c.ReadRequest(time.Time{})
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) {
				log.Info("agent closed the connection")
				return err
			}
			return e.protocolError(id, nil, fmt.Sprintf("bad packet: %v", err))
		}
		select {
		case <-e.hang:
			// Stuck: the request stays unanswered and the connection
			// open; nothing is read or sent any more.
			closeAll(files)
			log.Warn("hung: not answering", "op", zp.RequestOp(req), "uid", zp.RequestUID(req))
			<-ctx.Done()
			return ctx.Err()
		default:
		}
		ackMsg, perr := e.handle(s, req, files)
		if perr != "" {
			return e.protocolError(id, req, perr)
		}
		if err := c.Send(zp.AckResponse(ackMsg), nil, time.Now().Add(5*time.Second)); err != nil {
			return fmt.Errorf("send ack: %w", err)
		}
	}
}

// sessionState is what ztunnel tracks per connection.
type sessionState struct {
	id           int
	snapshot     map[string]bool // uids mentioned before SnapshotSent
	snapshotSent bool
}

// handle applies one request and returns the ack error to send, or a
// protocol violation (then nothing is sent and the connection ends). It takes
// ownership of files.
func (e *Emulator) handle(s *sessionState, req *zp.WorkloadRequest, files []*os.File) (ackErr, protoErr string) {
	rec := RequestRecord{ConnID: s.id, Op: zp.RequestOp(req), UID: zp.RequestUID(req), FDs: len(files), At: time.Now()}
	if info := req.GetAdd().GetWorkloadInfo(); info != nil {
		rec.Name, rec.Namespace, rec.ServiceAccount = info.GetName(), info.GetNamespace(), info.GetServiceAccount()
	}
	if len(files) == 1 {
		if _, ino, err := fileID(files[0]); err == nil {
			rec.NetnsInode = ino
		}
	}
	defer func() {
		rec.AckError, rec.ProtocolError = ackErr, protoErr
		e.update(func() {
			e.requests = appendCapped(e.requests, rec, e.cfg.MaxRecords)
			// Flagged together with the record, so a WaitFor on the flag
			// sees the whole snapshot's requests.
			if rec.Op == zp.OpSnapshotSent && protoErr == "" {
				for i := range e.conns {
					if e.conns[i].ID == s.id {
						e.conns[i].SnapshotSent = true
					}
				}
			}
		})
	}()

	switch p := req.GetPayload().(type) {
	case *zp.WorkloadRequest_Add:
		if p.Add.GetWorkloadInfo() == nil {
			closeAll(files)
			return "", fmt.Sprintf("add %q without workload_info", rec.UID)
		}
		if len(files) != 1 {
			closeAll(files)
			return "", fmt.Sprintf("add %q with %d file descriptors, want exactly 1", rec.UID, len(files))
		}
		if rec.UID == "" {
			closeAll(files)
			return "", "add without uid"
		}
		if !s.snapshotSent {
			s.snapshot[rec.UID] = true
			e.recordSnapshot(s.id, zp.OpAdd, rec.UID)
		}
		return e.add(s.id, rec, files[0]), ""
	case *zp.WorkloadRequest_Keep:
		if s.snapshotSent {
			return "", fmt.Sprintf("keep %q after SnapshotSent", rec.UID)
		}
		s.snapshot[rec.UID] = true
		e.recordSnapshot(s.id, zp.OpKeep, rec.UID)
		return "", ""
	case *zp.WorkloadRequest_SnapshotSent:
		if s.snapshotSent {
			return "", "second SnapshotSent on one connection"
		}
		s.snapshotSent = true
		e.finishSnapshot(s)
		return "", ""
	case *zp.WorkloadRequest_Del:
		delete(s.snapshot, rec.UID)
		e.remove(rec.UID) // unknown uid: fine, like ztunnel
		return "", ""
	}
	return "", "request without payload"
}

// add installs a workload and returns the ack error ("" = OK).
func (e *Emulator) add(connID int, rec RequestRecord, f *os.File) string {
	dev, ino, err := fileID(f)
	if err != nil {
		f.Close()
		return fmt.Sprintf("cannot stat netns fd: %v", err)
	}
	if msg := e.nackFor(rec); msg != "" {
		f.Close()
		return msg
	}
	e.mu.Lock()
	old := e.workloads[rec.UID]
	e.mu.Unlock()
	if old != nil && old.dev == dev && old.ino == ino {
		f.Close() // same pod, same netns: nothing to do, like ztunnel
		return ""
	}
	if old != nil {
		e.remove(rec.UID) // netns changed (pod sandbox recreated): replace
	}
	w := &workload{
		info:  Workload{UID: rec.UID, Name: rec.Name, Namespace: rec.Namespace, ServiceAccount: rec.ServiceAccount, NetnsInode: ino, ConnID: connID},
		netns: f, dev: dev, ino: ino,
	}
	if e.cfg.NetnsMode {
		ls, err := listenInNetns(f, e.cfg.Ports, e.cfg.Mark)
		if err != nil {
			f.Close()
			e.log.Error("cannot listen in workload netns", "uid", rec.UID, "err", err)
			return fmt.Sprintf("ztunnel emulator: listen in netns: %v", err)
		}
		pcs, err := dnsInNetns(f, e.cfg.Mark)
		if err != nil {
			for _, l := range ls {
				l.Close()
			}
			f.Close()
			e.log.Error("cannot listen in workload netns", "uid", rec.UID, "err", err)
			return fmt.Sprintf("ztunnel emulator: listen in netns: %v", err)
		}
		w.listeners, w.dns = ls, pcs
		for _, l := range ls {
			w.info.Listeners = append(w.info.Listeners, l.addr)
			e.lwg.Go(func() { e.acceptLoop(rec.UID, l) })
		}
		for _, pc := range pcs {
			e.lwg.Go(func() { e.serveDNS(rec.UID, pc) })
		}
	}
	e.update(func() { e.workloads[rec.UID] = w })
	e.log.Info("workload added", "uid", rec.UID, "pod", rec.Namespace+"/"+rec.Name, "netns_inode", ino, "conn", connID)
	return ""
}

func (e *Emulator) nackFor(rec RequestRecord) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if msg, ok := e.nacks[rec.UID]; ok {
		return msg
	}
	return e.nacks[rec.Namespace+"/"+rec.Name]
}

// remove drops a workload: listeners first, then its netns.
func (e *Emulator) remove(uid string) {
	e.mu.Lock()
	w := e.workloads[uid]
	delete(e.workloads, uid)
	e.mu.Unlock()
	if w == nil {
		return
	}
	w.close()
	e.update(func() {})
	e.log.Info("workload removed", "uid", uid)
}

func (w *workload) close() {
	for _, l := range w.listeners {
		l.Close()
	}
	for _, pc := range w.dns {
		pc.Close()
	}
	w.netns.Close()
}

// finishSnapshot drops every workload this connection's snapshot did not
// mention, as ztunnel does on SnapshotSent.
func (e *Emulator) finishSnapshot(s *sessionState) {
	e.mu.Lock()
	var stale []string
	for uid := range e.workloads {
		if !s.snapshot[uid] {
			stale = append(stale, uid)
		}
	}
	e.mu.Unlock()
	for _, uid := range stale {
		e.remove(uid)
	}
	e.update(func() {})
	e.log.Info("snapshot complete", "workloads", len(s.snapshot), "dropped", len(stale))
}

func (e *Emulator) dropAll() {
	e.mu.Lock()
	uids := slices.Collect(maps.Keys(e.workloads))
	e.mu.Unlock()
	for _, uid := range uids {
		e.remove(uid)
	}
	e.lwg.Wait()
}

func (e *Emulator) protocolError(connID int, req *zp.WorkloadRequest, msg string) error {
	e.log.Error("PROTOCOL ERROR from agent (real ztunnel would exit)", "conn", connID, "error", msg, "request", req.String())
	e.update(func() {
		e.protoErrs = appendCapped(e.protoErrs, ProtocolError{ConnID: connID, Message: msg}, e.cfg.MaxRecords)
	})
	return fmt.Errorf("%w: %s", ErrProtocolExit, msg)
}

func (e *Emulator) connOpened(c *zp.Conn) int {
	var id int
	e.update(func() {
		id = len(e.conns) + 1
		e.conns = append(e.conns, ConnRecord{ID: id})
		e.current, e.currentID = c, id
	})
	return id
}

func (e *Emulator) connClosed(id int) {
	e.update(func() {
		for i := range e.conns {
			if e.conns[i].ID == id {
				e.conns[i].Closed = true
			}
		}
		if e.currentID == id {
			e.current, e.currentID = nil, 0
		}
	})
}

func (e *Emulator) recordSnapshot(id int, op, uid string) {
	e.update(func() {
		for i := range e.conns {
			if e.conns[i].ID == id {
				e.conns[i].Snapshot = append(e.conns[i].Snapshot, SnapshotItem{Op: op, UID: uid})
			}
		}
	})
}

// update runs f under the lock and wakes WaitFor callers.
func (e *Emulator) update(f func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	f()
	close(e.changed)
	e.changed = make(chan struct{})
}

// Hang makes the emulator stop answering, as a stuck ztunnel does (a
// deadlock, a full queue): its connection stays open, the next request is
// read but never acked, nothing more is read or sent, and it never
// reconnects — until Run's context ends. Only another emulator (a ztunnel
// restart) serves the node again.
func (e *Emulator) Hang() { e.hangOnce.Do(func() { close(e.hang) }) }

// Disconnect closes the live connection, as a ztunnel restart would; Run
// reconnects and gets a fresh snapshot. Workloads are kept.
func (e *Emulator) Disconnect() {
	e.mu.Lock()
	c := e.current
	e.mu.Unlock()
	if c != nil {
		c.Close()
	}
}

// SetNack makes Adds of the workload (uid or namespace/name) fail with msg.
func (e *Emulator) SetNack(key, msg string) { e.update(func() { e.nacks[key] = msg }) }

// ClearNack undoes SetNack.
func (e *Emulator) ClearNack(key string) { e.update(func() { delete(e.nacks, key) }) }

// State returns a copy of everything the emulator has seen.
func (e *Emulator) State() State {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.stateLocked()
}

func (e *Emulator) stateLocked() State {
	st := State{
		Connected:      e.currentID != 0,
		CurrentConn:    e.currentID,
		Requests:       slices.Clone(e.requests),
		Accepted:       slices.Clone(e.accepted),
		ProtocolErrors: slices.Clone(e.protoErrs),
		Nacks:          maps.Clone(e.nacks),
	}
	for _, c := range e.conns {
		c.Snapshot = slices.Clone(c.Snapshot)
		st.Connections = append(st.Connections, c)
	}
	for _, w := range e.workloads {
		info := w.info
		info.Listeners = slices.Clone(info.Listeners)
		st.Workloads = append(st.Workloads, info)
	}
	slices.SortFunc(st.Workloads, func(a, b Workload) int {
		switch {
		case a.UID < b.UID:
			return -1
		case a.UID > b.UID:
			return 1
		}
		return 0
	})
	return st
}

// WaitFor blocks until cond holds for the state or ctx is done; the error
// then includes the last state seen, to make test failures readable.
func (e *Emulator) WaitFor(ctx context.Context, cond func(State) bool) error {
	for {
		e.mu.Lock()
		st := e.stateLocked()
		ch := e.changed
		e.mu.Unlock()
		if cond(st) {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("ztunnel emulator: condition not met: %w; last state: %+v", ctx.Err(), st)
		}
	}
}

func fileID(f *os.File) (dev, ino uint64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, 0, fmt.Errorf("fstat %s: %w", f.Name(), err)
	}
	return st.Dev, st.Ino, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

func appendCapped[T any](s []T, v T, limit int) []T {
	if len(s) >= limit {
		s = slices.Delete(s, 0, len(s)-limit+1)
	}
	return append(s, v)
}
