package cniplugin

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ambientd/ambientd/cniapi"
)

// maxDelTimeout caps the DEL's best-effort call: a DEL never fails because of
// the agent, so it must not hold pod teardown for the full ADD timeout.
const maxDelTimeout = 5 * time.Second

// Config is the plugin's entry in the conflist: CNI's standard keys and
// the plugin's own (cniapi.PluginSettings, the schema the installer writes).
type Config struct {
	types.PluginConf
	cniapi.PluginSettings

	timeout  time.Duration
	logLevel slog.Level
}

// parseConfig decodes stdin, applies defaults and parses prevResult into the
// result type of its cniVersion (nil when there is none).
func parseConfig(stdin []byte) (*Config, error) {
	conf := &Config{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "ambientd-cni: cannot decode network config", err.Error())
	}
	if conf.AgentSocket == "" {
		conf.AgentSocket = cniapi.DefaultSocketPath
	}
	if !filepath.IsAbs(conf.AgentSocket) {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: invalid agentSocket",
			fmt.Sprintf("agentSocket %q must be an absolute path", conf.AgentSocket))
	}
	conf.timeout = cniapi.DefaultPluginTimeout
	if conf.Timeout != "" {
		d, err := time.ParseDuration(conf.Timeout)
		if err != nil || d < cniapi.MinPluginTimeout || d > cniapi.MaxPluginTimeout {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: invalid timeout",
				fmt.Sprintf("timeout %q must be a Go duration from %v to %v such as \"30s\"", conf.Timeout, cniapi.MinPluginTimeout, cniapi.MaxPluginTimeout))
		}
		conf.timeout = d
	}
	switch strings.ToLower(conf.LogLevel) {
	case "", "info":
		conf.logLevel = slog.LevelInfo
	case "debug":
		conf.logLevel = slog.LevelDebug
	case "warn", "warning":
		conf.logLevel = slog.LevelWarn
	case "error":
		conf.logLevel = slog.LevelError
	default:
		return nil, types.NewError(types.ErrInvalidNetworkConfig, "ambientd-cni: invalid logLevel",
			fmt.Sprintf("logLevel %q is not one of debug, info, warn, error", conf.LogLevel))
	}
	if conf.RawPrevResult != nil {
		if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
			return nil, types.NewError(types.ErrDecodingFailure, "ambientd-cni: cannot parse prevResult", err.Error())
		}
	}
	return conf, nil
}

func (c *Config) excluded(namespace string) bool {
	return slices.Contains(c.ExcludeNamespaces, namespace)
}

// k8sArgs are the CNI_ARGS keys Kubernetes runtimes set; types.LoadArgs
// matches keys to field names, hence the spelling.
type k8sArgs struct {
	types.CommonArgs
	K8S_POD_NAME               types.UnmarshallableString
	K8S_POD_NAMESPACE          types.UnmarshallableString
	K8S_POD_UID                types.UnmarshallableString
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
}

// podIdentity reads the pod from CNI_ARGS. ok is false when CNI_ARGS carries
// no Kubernetes keys at all: not a Kubernetes pod, so the plugin passes it
// through. Name without namespace (or the reverse) is an error: it is a
// Kubernetes pod the agent might want, and we cannot say which one.
func podIdentity(cniArgs, containerID string) (pod *cniapi.Pod, ok bool, err error) {
	a := k8sArgs{}
	// Runtimes pass keys meant for other plugins; read only ours.
	if err := types.LoadArgs(ignoreUnknown(cniArgs), &a); err != nil {
		return nil, false, types.NewError(types.ErrInvalidEnvironmentVariables, "ambientd-cni: cannot parse CNI_ARGS", err.Error())
	}
	name, ns := string(a.K8S_POD_NAME), string(a.K8S_POD_NAMESPACE)
	if name == "" && ns == "" && a.K8S_POD_UID == "" && a.K8S_POD_INFRA_CONTAINER_ID == "" {
		return nil, false, nil
	}
	if name == "" || ns == "" {
		return nil, false, types.NewError(types.ErrInvalidEnvironmentVariables, "ambientd-cni: incomplete pod identity in CNI_ARGS",
			fmt.Sprintf("K8S_POD_NAME=%q K8S_POD_NAMESPACE=%q: both are required", name, ns))
	}
	infra := string(a.K8S_POD_INFRA_CONTAINER_ID)
	if infra == "" {
		infra = containerID
	}
	return &cniapi.Pod{Name: name, Namespace: ns, Uid: string(a.K8S_POD_UID), InfraContainerId: infra}, true, nil
}

// ignoreUnknown makes types.LoadArgs skip keys we do not know, which it only
// does when IgnoreUnknown is among the args themselves.
func ignoreUnknown(args string) string {
	if args == "" {
		return ""
	}
	return "IgnoreUnknown=1;" + args
}
