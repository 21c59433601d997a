package bundle

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambientd/ambientd/cniapi"
	"github.com/ambientd/ambientd/nodeagent/admin"
	"github.com/ambientd/ambientd/nodeagent/kube"
)

// File is one file the caller made (version, settings, rules).
type File struct {
	Name string
	Data []byte
}

// Sources say where the agent's parts are on this node.
type Sources struct {
	// Files are written first, as given (redacted and capped like all).
	Files []File
	// AdminSocket is the agent's admin socket ("" skips the status).
	AdminSocket string
	// CNIConfDir and CNIBinDir are the CNI dirs as mounted; PluginName
	// is the plugin binary's name in the bin dir (its lease and kubeconfig
	// are named after it).
	CNIConfDir, CNIBinDir, PluginName string
	// MetricsAddr is the agent's --metrics-addr ("" skips the metrics).
	MetricsAddr string
	// Client reads the node's Events (nil: no usable kubeconfig, noted).
	Client kube.Interface
	// NodeName is this node's name.
	NodeName string
}

// Per-request bound of each collector, within the caller's context.
const requestTimeout = 10 * time.Second

// readMargin is read past the per-file cap so that redaction sees a
// credential that crosses the cut whole, and never keeps a piece of it.
const readMargin = 64 << 10

// readCap bounds what is read of any one source before the archive cuts
// it: a file or response larger than a cap is never read whole.
func readCap(a *Archive) int64 { return a.limits.MaxFileBytes + readMargin }

// Collect writes every section into a. A section that cannot be collected
// is a note in the manifest; Collect itself never fails.
func Collect(ctx context.Context, a *Archive, src Sources) {
	for _, f := range src.Files {
		a.Add(f.Name, f.Data)
	}
	st, ok := collectStatus(ctx, a, src.AdminSocket)
	collectErrors(a, st, ok)
	collectCNI(a, src)
	collectEvents(ctx, a, src)
	collectMetrics(ctx, a, src.MetricsAddr)
}

func jsonBytes(v any) []byte {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return []byte(err.Error())
	}
	return append(b, '\n')
}

// collectStatus writes status.json (GET /v1/status) and one
// pods/<namespace>/<name>.json (GET /v1/pod: the pod and the live rules of
// its netns) per pod of the node.
func collectStatus(ctx context.Context, a *Archive, socket string) (admin.NodeStatus, bool) {
	if socket == "" {
		a.Note("status: no admin socket given")
		return admin.NodeStatus{}, false
	}
	c := admin.NewClient(socket)
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	st, err := c.Status(rctx)
	cancel()
	if err != nil {
		a.Note("status: %v", err)
		return st, false
	}
	a.Add("status.json", jsonBytes(st))
	for _, p := range st.Pods {
		name := "pods/" + safeName(p.Namespace) + "/" + safeName(p.Name) + ".json"
		if ctx.Err() != nil {
			a.Note("%s: %v", name, ctx.Err())
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		d, err := c.Pod(rctx, p.Namespace, p.Name)
		cancel()
		if err != nil {
			a.Note("%s: %v", name, err)
			continue
		}
		a.Add(name, jsonBytes(d))
	}
	return st, true
}

var unsafeChars = regexp.MustCompile(`[^A-Za-z0-9._-]`)

// safeName keeps an archive path component inside its directory.
func safeName(s string) string {
	s = unsafeChars.ReplaceAllString(s, "_")
	if s == "" || s == "." || s == ".." {
		return "_" + s
	}
	return s
}

// collectErrors writes errors.txt: the agent's not-ready checks and every
// pod's last error, as the admin socket reports them.
func collectErrors(a *Archive, st admin.NodeStatus, ok bool) {
	if !ok {
		a.Note("errors.txt: not written: the agent's status could not be read")
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "agent on node %s, %s\n", st.Node, st.Time.UTC().Format(time.RFC3339))
	if len(st.NotReady) == 0 {
		b.WriteString("agent: ready\n")
	}
	for _, r := range st.NotReady {
		fmt.Fprintf(&b, "agent not ready: %s\n", r)
	}
	fmt.Fprintf(&b, "node readiness: %s %s\nplugin: %s\n", st.NodeReadiness, strings.Join(st.Readiness, "; "), st.Plugin)
	n := 0
	for _, p := range st.Pods {
		if p.LastError != "" {
			fmt.Fprintf(&b, "pod %s/%s (%s): %s\n", p.Namespace, p.Name, p.Phase, p.LastError)
			n++
		}
	}
	fmt.Fprintf(&b, "%d of %d pods with an error\n", n, len(st.Pods))
	a.Add("errors.txt", []byte(b.String()))
}

// cniConfigName matches the files the runtime and the CNIs read as
// network configs, and their backups (10-calico.conflist.cilium_bak):
// only these are copied. Everything else in the conf dir (Calico's
// calico-kubeconfig, Multus's multus.d/multus.kubeconfig) is listed only.
var cniConfigName = regexp.MustCompile(`\.(conf|conflist|json)(\.[A-Za-z0-9_-]+)?$`)

// collectCNI writes the conf dir's listing and its configs, the bin dir's
// listing and the install lease. The plugin's kubeconfig beside the lease
// is never read.
func collectCNI(a *Archive, src Sources) {
	if src.CNIConfDir != "" {
		entries, listing := list(src.CNIConfDir)
		a.Add("cni/conf-dir.txt", listing)
		for _, e := range entries {
			if !e.Type().IsRegular() && e.Type()&fs.ModeSymlink == 0 {
				continue
			}
			if !cniConfigName.MatchString(e.Name()) || strings.Contains(strings.ToLower(e.Name()), "kubeconfig") {
				continue
			}
			path := filepath.Join(src.CNIConfDir, e.Name())
			if e.Type()&fs.ModeSymlink != 0 && !linksWithin(src.CNIConfDir, path) {
				a.Note("cni/conf/%s: a symlink leading out of the conf dir: not followed", e.Name())
				continue
			}
			data, size, err := readBounded(path, readCap(a))
			if err != nil {
				a.Note("cni/conf/%s: %v", e.Name(), err)
				continue
			}
			a.AddSized("cni/conf/"+safeName(e.Name()), data, size)
		}
	}
	if src.CNIBinDir != "" {
		_, listing := list(src.CNIBinDir)
		a.Add("cni/bin-dir.txt", listing)
		lease := filepath.Join(src.CNIBinDir, src.PluginName+cniapi.LeaseSuffix)
		data, size, err := readBounded(lease, readCap(a))
		if err != nil {
			a.Note("cni/install-lease.json: %v", err)
		} else {
			a.AddSized("cni/install-lease.json", data, size)
		}
	}
}

// list returns dir's entries and a listing: mode, size, time, name and a
// symlink's target.
func list(dir string) ([]os.DirEntry, []byte) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, []byte(fmt.Sprintf("%s: %v\n", dir, err))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n", dir)
	for _, e := range entries {
		info, err := e.Info()
		if err != nil {
			fmt.Fprintf(&b, "?          %s: %v\n", e.Name(), err)
			continue
		}
		line := fmt.Sprintf("%s %10d %s %s", info.Mode(), info.Size(), info.ModTime().UTC().Format(time.RFC3339), e.Name())
		if info.Mode()&fs.ModeSymlink != 0 {
			if t, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
				line += " -> " + t
			}
		}
		b.WriteString(line + "\n")
	}
	return entries, []byte(b.String())
}

// readBounded reads at most n bytes of a regular file and returns them
// with the file's size.
func readBounded(path string, n int64) ([]byte, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	b, err := io.ReadAll(io.LimitReader(f, n))
	return b, fi.Size(), err
}

// linksWithin reports whether the symlink path resolves to a file inside
// dir: the conf dir is a host dir mounted into the agent's container, where
// a link out of it names another file than on the host.
func linksWithin(dir, path string) bool {
	target, err := filepath.EvalSymlinks(path)
	if err != nil {
		return false
	}
	realDir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return false
	}
	rel, err := filepath.Rel(realDir, target)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator))
}

// collectEvents writes events.txt: the Events about this node, newest
// last, through the API.
func collectEvents(ctx context.Context, a *Archive, src Sources) {
	if src.Client == nil {
		a.Note("events.txt: not written: no usable kubeconfig (--kubeconfig, $KUBECONFIG or in-cluster)")
		return
	}
	if src.NodeName == "" {
		a.Note("events.txt: not written: no node name (--node-name or NODE_NAME)")
		return
	}
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	list, err := src.Client.CoreV1().Events("").List(rctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + src.NodeName,
	})
	if err != nil {
		a.Note("events.txt: the node's Events: %v", err)
		return
	}
	evs := list.Items
	slices.SortStableFunc(evs, func(x, y corev1.Event) int { return eventTime(x).Compare(eventTime(y)) })
	var b strings.Builder
	fmt.Fprintf(&b, "Events of node %s (%d)\n", src.NodeName, len(evs))
	for _, e := range evs {
		fmt.Fprintf(&b, "%s %-7s %-24s %-20s x%d %s\n", eventTime(e).UTC().Format(time.RFC3339), e.Type, e.Reason, eventSource(e), max(e.Count, 1), strings.Join(strings.Fields(e.Message), " "))
	}
	a.Add("events.txt", []byte(b.String()))
}

// collectMetrics writes metrics.txt: the agent's /metrics, as scraped.
func collectMetrics(ctx context.Context, a *Archive, addr string) {
	if addr == "" {
		a.Note("metrics.txt: not written: no metrics address")
		return
	}
	url := "http://" + scrapeAddr(addr) + "/metrics"
	rctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
	if err != nil {
		a.Note("metrics.txt: %v", err)
		return
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		a.Note("metrics.txt: %v", err)
		return
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, readCap(a)))
	if err != nil {
		a.Note("metrics.txt: %s: %v", url, err)
		return
	}
	if resp.StatusCode != http.StatusOK {
		a.Note("metrics.txt: %s: %s", url, resp.Status)
		return
	}
	a.Add("metrics.txt", body)
}

// scrapeAddr turns a listen address into one to dial: ":15014" and
// "0.0.0.0:15014" are this host's loopback.
func scrapeAddr(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	switch host {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::":
		host = "::1"
	}
	return net.JoinHostPort(host, port)
}

// eventTime is when an Event last happened, whichever field its recorder
// filled.
func eventTime(e corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	case !e.FirstTimestamp.IsZero():
		return e.FirstTimestamp.Time
	}
	return e.CreationTimestamp.Time
}

// eventSource names who recorded an Event.
func eventSource(e corev1.Event) string {
	switch {
	case e.ReportingController != "":
		return e.ReportingController
	case e.Source.Component != "":
		return e.Source.Component
	}
	return "-"
}
