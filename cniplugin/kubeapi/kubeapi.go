// Package kubeapi is the least the CNI plugin needs of the Kubernetes API
// while no agent answers on its socket: one pod, its namespace, and whether
// the agent's DaemonSet still exists, read with the credentials the
// installer keeps beside the plugin binary (cniapi.KubeconfigSuffix). It
// uses client-go's kubeconfig loader and transport only (no typed clients,
// no scheme of every API group): the plugin is exec'd for every pod, and
// its start must stay cheap on the path where the agent answers.
package kubeapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambientd/ambientd/cniplugin/internal/ownedfile"
)

// maxKubeconfig and maxBody bound what the plugin reads.
const (
	maxKubeconfig = 1 << 20
	maxBody       = 4 << 20
)

// ErrNotFound is the API server's own answer that an object does not exist
// (a Status of reason NotFound naming the kind asked for): the only 404 the
// plugin takes as proof.
var ErrNotFound = errors.New("not found")

// Client reads the API for the plugin.
type Client struct {
	host string
	http *http.Client
}

// Load reads the kubeconfig at path. It refuses a file that is not a
// regular file owned by this process's user (root, under a runtime) and
// readable by nobody else: it holds the agent's credentials.
func Load(path string) (*Client, error) {
	data, err := ownedfile.Read(path, 0o077, maxKubeconfig)
	if err != nil {
		return nil, err
	}
	kc, err := clientcmd.Load(data)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	cfg, err := clientcmd.NewDefaultClientConfig(*kc, nil).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	cfg.UserAgent = "ambientd-cni"
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	return &Client{host: cfg.Host, http: hc}, nil
}

// Pod reads one pod.
func (c *Client) Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	var p corev1.Pod
	if err := c.get(ctx, "pods", &p, "api", "v1", "namespaces", namespace, "pods", name); err != nil {
		return nil, err
	}
	return &p, nil
}

// Namespace reads one namespace.
func (c *Client) Namespace(ctx context.Context, name string) (*corev1.Namespace, error) {
	var ns corev1.Namespace
	if err := c.get(ctx, "namespaces", &ns, "api", "v1", "namespaces", name); err != nil {
		return nil, err
	}
	return &ns, nil
}

// DaemonSetGone reports whether the API server says that the DaemonSet
// does not exist (in a namespace that does not exist, neither does it).
// Any answer but the server's own NotFound is an error.
func (c *Client) DaemonSetGone(ctx context.Context, namespace, name string) (bool, error) {
	var ds metav1.PartialObjectMetadata
	err := c.get(ctx, "daemonsets", &ds, "apis", "apps", "v1", "namespaces", namespace, "daemonsets", name)
	switch {
	case errors.Is(err, ErrNotFound):
		return true, nil
	case err != nil:
		return false, err
	}
	return false, nil
}

// get GETs the object at the path's segments into out. resource is the
// plural the server names in a NotFound Status.
func (c *Client) get(ctx context.Context, resource string, out any, segs ...string) error {
	u, err := url.JoinPath(c.host, segs...)
	if err != nil {
		return fmt.Errorf("API URL: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", u, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fmt.Errorf("GET %s: reading the answer: %w", u, err)
	}
	if resp.StatusCode == http.StatusOK {
		if err := json.Unmarshal(body, out); err != nil {
			return fmt.Errorf("GET %s: decoding the answer: %w", u, err)
		}
		return nil
	}
	var st metav1.Status
	if json.Unmarshal(body, &st) == nil && st.Kind == "Status" && resp.StatusCode == http.StatusNotFound &&
		st.Reason == metav1.StatusReasonNotFound && st.Details != nil && st.Details.Kind == resource {
		return fmt.Errorf("GET %s: %s: %w", u, st.Message, ErrNotFound)
	}
	msg := st.Message
	if msg == "" {
		msg = http.StatusText(resp.StatusCode)
	}
	return fmt.Errorf("GET %s: %d %s", u, resp.StatusCode, msg)
}
