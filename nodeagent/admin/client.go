package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"syscall"
)

// ErrAgentDown is returned when nothing answers on the socket.
var ErrAgentDown = errors.New("agent not running")

// Client asks a running agent. Every call is bounded by its ctx.
type Client struct {
	path string
	hc   *http.Client
}

// NewClient returns a client of the agent serving on path.
func NewClient(path string) *Client {
	var d net.Dialer
	return &Client{path: path, hc: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", path)
		},
		DisableKeepAlives: true,
	}}}
}

// Status returns the node status.
func (c *Client) Status(ctx context.Context) (NodeStatus, error) {
	var st NodeStatus
	return st, c.get(ctx, PathStatus, &st)
}

// Pod returns one pod and its live rules.
func (c *Client) Pod(ctx context.Context, namespace, name string) (PodDetail, error) {
	var d PodDetail
	q := url.Values{"namespace": {namespace}, "name": {name}}
	return d, c.get(ctx, PathPod+"?"+q.Encode(), &d)
}

func (c *Client) get(ctx context.Context, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://ambientd"+path, nil)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		var op *net.OpError
		switch {
		case errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM):
			return fmt.Errorf("ask agent at %s: %w (the admin socket is root only)", c.path, err)
		case errors.As(err, &op) && op.Op == "dial":
			return fmt.Errorf("%w at %s: %w", ErrAgentDown, c.path, op.Err)
		}
		return fmt.Errorf("ask agent at %s: %w", c.path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return fmt.Errorf("read answer of agent at %s: %w", c.path, err)
	}
	if resp.StatusCode != http.StatusOK {
		msg := strings.TrimSpace(string(body))
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%s: %w", strings.TrimSuffix(msg, ": "+ErrNotFound.Error()), ErrNotFound)
		}
		return fmt.Errorf("agent at %s: %s: %s", c.path, resp.Status, msg)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("agent at %s: bad answer: %w", c.path, err)
	}
	return nil
}
