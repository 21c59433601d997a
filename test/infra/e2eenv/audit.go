package e2eenv

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"
)

// auditPolicyYAML logs every request but the test's own (the admin user's)
// once it is answered (a watch also when it starts), at Metadata level: who
// asked, what, and the answer's code — what a control plane pays for. Status
// writes and Events also keep their body, so a test can say what a write changed.
const auditPolicyYAML = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
- level: None
  users: ["` + AdminUser + `"]
- level: Request
  verbs: ["create", "patch", "update"]
  resources:
  - group: ""
    resources: ["pods/status", "nodes/status", "events"]
- level: Request
  verbs: ["create", "patch", "update"]
  resources:
  - group: "events.k8s.io"
    resources: ["events"]
- level: Metadata
`

// AuditRequest is one request from the apiserver's audit log.
type AuditRequest struct {
	Received    time.Time
	User        string
	UserAgent   string
	Verb        string // get, list, watch, create, update, patch, delete, …
	Resource    string // pods, nodes, events, …
	Subresource string // status, …
	Namespace   string
	Name        string
	Code        int
	Body        string // the request's body, for status writes
	// SourceIP is the client's address as the apiserver saw it (the first
	// of the event's sourceIPs): it tells apart agents that share one
	// identity but each reach the apiserver from a node address of its own.
	SourceIP string
}

// Write reports whether the request changes state.
func (r AuditRequest) Write() bool {
	switch r.Verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}

func (r AuditRequest) String() string {
	res := r.Resource
	if r.Subresource != "" {
		res += "/" + r.Subresource
	}
	s := fmt.Sprintf("%s %s %s/%s (%d, %s)", r.Received.Format("15:04:05.000"), r.Verb, res, r.Name, r.Code, r.UserAgent)
	if r.Body != "" {
		s += " " + r.Body
	}
	return s
}

// auditEvent is the part of an audit.k8s.io/v1 Event AuditRequests reads.
type auditEvent struct {
	AuditID   string   `json:"auditID"`
	Stage     string   `json:"stage"`
	Verb      string   `json:"verb"`
	UserAgent string   `json:"userAgent"`
	SourceIPs []string `json:"sourceIPs"`
	User      struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
		Name        string `json:"name"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	Received      time.Time       `json:"requestReceivedTimestamp"`
	RequestObject json.RawMessage `json:"requestObject"`
}

// AuditRequests returns the requests user made that the apiserver received
// in [from, to), once each (a watch is logged when it starts and when it
// ends), oldest first.
func (cp *ControlPlane) AuditRequests(from, to time.Time, user string) ([]AuditRequest, error) {
	f, err := os.Open(cp.AuditLog)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	seen := map[string]bool{}
	var out []AuditRequest
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var ev auditEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("audit log %s: %w", cp.AuditLog, err)
		}
		if ev.User.Username != user || seen[ev.AuditID] || ev.Received.Before(from) || !ev.Received.Before(to) {
			continue
		}
		seen[ev.AuditID] = true
		r := AuditRequest{Received: ev.Received, User: ev.User.Username, UserAgent: ev.UserAgent, Verb: ev.Verb}
		if len(ev.SourceIPs) > 0 {
			r.SourceIP = ev.SourceIPs[0]
		}
		if ev.ObjectRef != nil {
			r.Resource, r.Subresource, r.Namespace, r.Name = ev.ObjectRef.Resource, ev.ObjectRef.Subresource, ev.ObjectRef.Namespace, ev.ObjectRef.Name
		}
		if ev.ResponseStatus != nil {
			r.Code = ev.ResponseStatus.Code
		}
		if len(ev.RequestObject) > 0 {
			r.Body = string(ev.RequestObject)
		}
		out = append(out, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("audit log %s: %w", cp.AuditLog, err)
	}
	return out, nil
}

// Summary counts requests by verb and resource ("patch pods/status: 2").
func Summary(reqs []AuditRequest) string {
	counts := map[string]int{}
	var keys []string
	for _, r := range reqs {
		k := r.Verb + " " + r.Resource
		if r.Subresource != "" {
			k += "/" + r.Subresource
		}
		if counts[k] == 0 {
			keys = append(keys, k)
		}
		counts[k]++
	}
	var b strings.Builder
	for i, k := range keys {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s: %d", k, counts[k])
	}
	if b.Len() == 0 {
		return "none"
	}
	return b.String()
}
