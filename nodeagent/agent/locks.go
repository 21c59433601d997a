package agent

import (
	"context"
	"fmt"
	"sync"
)

// keyedMutex serialises work on one pod (CNI ADD/DEL, sync, snapshot
// refusals) without blocking other pods. Entries are dropped when unused.
// The map's mutex is held only to find an entry, never while waiting for one
// or across I/O.
type keyedMutex struct {
	mu sync.Mutex
	m  map[string]*keyedEntry
}

type keyedEntry struct {
	held chan struct{} // capacity 1: full while locked
	refs int
}

// lock waits for key's lock as long as it takes (background work).
func (k *keyedMutex) lock(key string) func() {
	unlock, _ := k.lockCtx(context.Background(), key)
	return unlock
}

// lockCtx waits for key's lock until ctx ends: a CNI ADD or DEL stuck
// behind a slow sync of the same pod gives up within its own deadline
// instead of past it.
func (k *keyedMutex) lockCtx(ctx context.Context, key string) (func(), error) {
	k.mu.Lock()
	if k.m == nil {
		k.m = make(map[string]*keyedEntry)
	}
	e := k.m[key]
	if e == nil {
		e = &keyedEntry{held: make(chan struct{}, 1)}
		k.m[key] = e
	}
	e.refs++
	k.mu.Unlock()
	drop := func() {
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.m, key)
		}
		k.mu.Unlock()
	}
	select {
	case e.held <- struct{}{}:
	case <-ctx.Done():
		drop()
		return func() {}, fmt.Errorf("waiting for the lock of pod %s: %w", key, ctx.Err())
	}
	return func() {
		<-e.held
		drop()
	}, nil
}

// broadcast wakes every waiter once per fire (a closed channel, replaced).
type broadcast struct {
	mu sync.Mutex
	ch chan struct{}
}

// wait returns a channel closed at the next fire.
func (b *broadcast) wait() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch == nil {
		b.ch = make(chan struct{})
	}
	return b.ch
}

func (b *broadcast) fire() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch != nil {
		close(b.ch)
		b.ch = nil
	}
}
