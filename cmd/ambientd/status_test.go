package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/nodeagent/admin"
)

func TestStatusCommand(t *testing.T) {
	none := filepath.Join(t.TempDir(), "admin.sock")
	tests := []struct {
		name     string
		args     []string
		env      map[string]string
		wantCode int
		wantErr  string
	}{
		{"agent down", []string{"--admin-socket", none}, nil, 1, "agent not running at " + none},
		{"agent down, socket from env", nil, map[string]string{"AMBIENTD_ADMIN_SOCKET": none}, 1, "agent not running at " + none},
		{"bad output", []string{"-o", "yaml"}, nil, 2, `-o "yaml": want table or json`},
		{"bad timeout", []string{"--timeout", "0s"}, nil, 2, "must be positive"},
		{"bad env timeout", nil, map[string]string{"AMBIENTD_STATUS_TIMEOUT": "soon"}, 2, "AMBIENTD_STATUS_TIMEOUT"},
		{"extra argument", []string{"pods"}, nil, 2, `unexpected argument "pods"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			start := time.Now()
			code := runStatus(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &out, &errb)
			if code != tt.wantCode || !strings.Contains(errb.String(), tt.wantErr) {
				t.Errorf("exit %d, stderr %q; want exit %d and %q", code, errb.String(), tt.wantCode, tt.wantErr)
			}
			if took := time.Since(start); took > 6*time.Second {
				t.Errorf("took %v; the default timeout is 5s", took)
			}
		})
	}
}

func TestAge(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for d, want := range map[time.Duration]string{
		45 * time.Second: "45s", 5 * time.Minute: "5m", 3 * time.Hour: "3h", 72 * time.Hour: "3d", -time.Second: "0s",
	} {
		if got := age(now.Add(-d), now); got != want {
			t.Errorf("age(%v) = %q, want %q", d, got, want)
		}
	}
	if got := age(time.Time{}, now); got != "-" {
		t.Errorf("age(zero) = %q, want -", got)
	}
}

// The table says how many requests the agent sent to the API server in the
// last minute, when the agent counts them.
func TestNodeStatusAPIRequests(t *testing.T) {
	n := 30
	for _, c := range []struct {
		st   admin.NodeStatus
		want string
	}{
		{admin.NodeStatus{Node: "n1", APIRequestsLastMinute: &n}, "api server:  30 requests in the last minute (0.50/s)"},
		{admin.NodeStatus{Node: "n1"}, ""},
	} {
		var b bytes.Buffer
		printNodeStatus(&b, c.st)
		if c.want != "" && !strings.Contains(b.String(), c.want) || c.want == "" && strings.Contains(b.String(), "api server:") {
			t.Errorf("status table:\n%s\nwant the line %q", b.String(), c.want)
		}
	}
}
