package e2eenv

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// EmulatorConfig configures StartEmulator.
type EmulatorConfig struct {
	// Socket the emulator connects to (default: the environment's ztunnel
	// socket, where the agent listens).
	Socket string
	// NetnsMode makes the emulator enter each pod netns it receives and
	// listen on 15001/15006/15008 there, like real ztunnel.
	NetnsMode bool
	// Args are extra flags (e.g. "--nack=ns/name=message").
	Args []string
	Name string // default "ztunnel-emulator"
}

// Emulator is a running bin/ztunnel-emulator with its status endpoint.
type Emulator struct {
	*Process
	Socket     string
	StatusAddr string
	http       *http.Client
}

// StartEmulator starts bin/ztunnel-emulator and waits until its status
// endpoint answers (it keeps reconnecting to the socket by itself, so the
// agent may start before or after it).
func (e *Env) StartEmulator(ctx context.Context, cfg EmulatorConfig) (*Emulator, error) {
	if err := requireBinary(e.Bins.Emulator); err != nil {
		return nil, err
	}
	if cfg.Socket == "" {
		cfg.Socket = e.ZtunnelSocket
	}
	if cfg.Name == "" {
		cfg.Name = "ztunnel-emulator"
	}
	if err := os.MkdirAll(filepath.Dir(cfg.Socket), 0o755); err != nil {
		return nil, err
	}
	status, err := FreeAddr()
	if err != nil {
		return nil, err
	}
	args := []string{"--socket=" + cfg.Socket, "--status-addr=" + status}
	if cfg.NetnsMode {
		args = append(args, "--netns-mode")
	}
	args = append(args, cfg.Args...)
	p := newProcess(e.sp, cfg.Name, e.Bins.Emulator, e.logPath(cfg.Name), args...)
	if err := p.Start(); err != nil {
		return nil, err
	}
	e.trackProcess(p)
	em := &Emulator{Process: p, Socket: cfg.Socket, StatusAddr: status, http: &http.Client{Timeout: 5 * time.Second}}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := p.WaitUntil(wctx, "emulator status endpoint", 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		_, err := em.StateJSON(ctx)
		return err == nil, err
	}); err != nil {
		_ = p.Stop(5 * time.Second)
		return nil, err
	}
	return em, nil
}

// StateJSON returns the body of GET /state.
func (em *Emulator) StateJSON(ctx context.Context) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+em.StatusAddr+"/state", nil)
	if err != nil {
		return nil, err
	}
	resp, err := em.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("emulator GET /state: %w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("emulator GET /state: %w", err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("emulator GET /state: status %d: %s", resp.StatusCode, truncate(string(b), 200))
	}
	return b, nil
}

// State decodes GET /state into v: pass the emulator library's State type
// (test/infra/ztunnelemu) for typed access, or a map for loose access.
func (em *Emulator) State(ctx context.Context, v any) error {
	b, err := em.StateJSON(ctx)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decode emulator state: %w", err)
	}
	return nil
}

// WaitState polls the state (every 50ms) until cond, given the raw JSON,
// returns true or an error, or ctx ends.
func (em *Emulator) WaitState(ctx context.Context, cond func(state []byte) (bool, error)) ([]byte, error) {
	var last []byte
	err := em.WaitUntil(ctx, "emulator state condition", 50*time.Millisecond, func(ctx context.Context) (bool, error) {
		b, err := em.StateJSON(ctx)
		if err != nil {
			return false, err
		}
		last = b
		ok, err := cond(b)
		if err != nil {
			return false, err
		}
		return ok, fmt.Errorf("condition not met")
	})
	if err != nil {
		return last, fmt.Errorf("%w; last state: %s", err, truncate(string(last), 2000))
	}
	return last, nil
}

// SetNack makes the emulator answer AddWorkload for workload ("ns/name")
// with the error message instead of an OK ack.
func (em *Emulator) SetNack(ctx context.Context, workload, message string) error {
	return em.do(ctx, http.MethodPost, "/nack?"+url.Values{"workload": {workload}, "error": {message}}.Encode())
}

// ClearNack makes the emulator ack workload's Adds again.
func (em *Emulator) ClearNack(ctx context.Context, workload string) error {
	return em.do(ctx, http.MethodDelete, "/nack?"+url.Values{"workload": {workload}}.Encode())
}

// Hang makes the emulator stop answering for good, as a stuck ztunnel
// does: its connection stays open, its next request is never acked, and
// it never reconnects (ztunnelemu.Emulator.Hang).
func (em *Emulator) Hang(ctx context.Context) error {
	return em.do(ctx, http.MethodPost, "/hang")
}

func (em *Emulator) do(ctx context.Context, method, path string) error {
	req, err := http.NewRequestWithContext(ctx, method, "http://"+em.StatusAddr+path, nil)
	if err != nil {
		return err
	}
	resp, err := em.http.Do(req)
	if err != nil {
		return fmt.Errorf("emulator %s %s: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("emulator %s %s: status %d: %s", method, path, resp.StatusCode, truncate(string(b), 200))
	}
	return nil
}
