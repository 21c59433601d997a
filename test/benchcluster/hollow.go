package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"

	"github.com/ambientd/ambientd/test/infra/e2eenv"
)

// The hollow nodes' network: one bridge in the benchmark's own (node)
// network namespace holding the apiserver's side, and one veth per hollow
// node into that node's network namespace. The agent reaches the apiserver
// at bridgeIP; the apiserver tells agents apart by their address.
const (
	bridgeName = "ambhollow0"
	bridgeCIDR = "10.251.0.1/16"
	bridgeIP   = "10.251.0.1"
	// Each agent's health and metrics ports, on loopback in its own network
	// namespace (so every agent can use the same ones).
	agentHealthAddr  = "127.0.0.1:15021"
	agentMetricsAddr = "127.0.0.1:15020"
)

// nodeIP is hollow node i's address on the bridge (i from 0): 10.251.0.2 on.
func nodeIP(i int) net.IP {
	n := i + 2
	return net.IPv4(10, 251, byte(n>>8), byte(n))
}

// hollow is one hollow node: a Node object, a network namespace with a link
// to the apiserver, an agent in that namespace and a ztunnel emulator on
// its socket. Nothing runs in the pods' place: pods of a hollow node exist
// only in the API.
type hollow struct {
	index    int
	name     string // the Node's name and the agent's --node-name
	ip       string // the node's address, as the apiserver's audit log shows it
	dir      string // run dir, sockets
	netns    ns.NetNS
	hostLink string // the veth's end on the bridge
	agent    *e2eenv.Process
	emulator *e2eenv.Emulator
	http     *http.Client // dials from inside the node's netns
}

// hollowNet is the bridge the hollow nodes hang on.
type hollowNet struct {
	bridge netlink.Link
}

func newHollowNet() (*hollowNet, error) {
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: bridgeName}}
	if err := netlink.LinkAdd(br); err != nil {
		return nil, fmt.Errorf("add bridge %s: %w", bridgeName, err)
	}
	addr, err := netlink.ParseAddr(bridgeCIDR)
	if err != nil {
		return nil, err
	}
	if err := netlink.AddrAdd(br, addr); err != nil {
		return nil, fmt.Errorf("address %s on %s: %w", bridgeCIDR, bridgeName, err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return nil, fmt.Errorf("set %s up: %w", bridgeName, err)
	}
	link, err := netlink.LinkByName(bridgeName)
	if err != nil {
		return nil, err
	}
	return &hollowNet{bridge: link}, nil
}

// close removes the bridge (the veths went with their namespaces).
func (n *hollowNet) close() error {
	if err := netlink.LinkDel(n.bridge); err != nil {
		return fmt.Errorf("delete bridge %s: %w", bridgeName, err)
	}
	return nil
}

// hollowSpec is what every hollow node's agent shares.
type hollowSpec struct {
	env        *e2eenv.Env
	kubeconfig string   // reaches the apiserver at bridgeIP
	agentArgs  []string // extra `ambientd run` flags
	nsenter    string
}

// startHollow creates node i (Node object, netns, link), and starts its
// emulator and its agent. It does not wait for the agent's readiness.
func startHollow(ctx context.Context, spec hollowSpec, net *hollowNet, i int) (h *hollow, err error) {
	env := spec.env
	h = &hollow{index: i, name: fmt.Sprintf("hollow-%03d", i), ip: nodeIP(i).String()}
	h.dir = filepath.Join(env.Dir, "hollow", fmt.Sprintf("%03d", i))
	defer func() {
		if err != nil {
			err = errors.Join(fmt.Errorf("hollow node %s: %w", h.name, err), h.close())
		}
	}()
	if err := os.MkdirAll(h.dir, 0o755); err != nil {
		return h, err
	}
	if _, err := e2eenv.CreateNode(ctx, env.CP.Admin, h.name, nil); err != nil {
		return h, err
	}
	if h.netns, err = e2eenv.NewNetns(filepath.Join(env.Dir, "hollow", "netns"), h.name); err != nil {
		return h, err
	}
	if err := h.link(net); err != nil {
		return h, err
	}
	h.http = &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: h.dial, DisableKeepAlives: true}}

	if h.emulator, err = env.StartEmulator(ctx, e2eenv.EmulatorConfig{
		Socket: filepath.Join(h.dir, "ztunnel.sock"), Name: "ztunnel-emulator-" + h.name,
	}); err != nil {
		return h, err
	}
	args := append([]string{
		"--net=" + h.netns.Path(), "--", env.Bins.Agent, "run",
		"--kubeconfig=" + spec.kubeconfig,
		"--node-name=" + h.name,
		"--run-dir=" + h.dir,
		"--ztunnel-socket=" + filepath.Join(h.dir, "ztunnel.sock"),
		"--cni-socket=" + filepath.Join(h.dir, "cni.sock"),
		"--admin-socket=" + filepath.Join(h.dir, "admin.sock"),
		"--health-addr=" + agentHealthAddr,
		"--metrics-addr=" + agentMetricsAddr,
		"--host-proc=/proc",
		"--install-cni=false",
		// The environment's chain lists our plugin: "plugin installed".
		"--cni-conf-dir=" + filepath.Dir(env.Chain.ConflistPath),
	}, spec.agentArgs...)
	// nsenter enters the node's netns and execs the agent in its place
	// (same pid): stopping the process stops the agent.
	if h.agent, err = env.StartProcess("agent-"+h.name, spec.nsenter, nil, args...); err != nil {
		return h, err
	}
	return h, nil
}

// link gives the node's netns lo and eth0 (a veth on the bridge) with the
// node's address.
func (h *hollow) link(hn *hollowNet) error {
	h.hostLink = fmt.Sprintf("hv%d", h.index)
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: h.hostLink, MasterIndex: hn.bridge.Attrs().Index},
		PeerName:      "eth0",
		PeerNamespace: netlink.NsFd(int(h.netns.Fd())),
	}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("add veth %s: %w", h.hostLink, err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		return fmt.Errorf("set %s up: %w", h.hostLink, err)
	}
	return h.netns.Do(func(ns.NetNS) error {
		for _, name := range []string{"lo", "eth0"} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if name == "eth0" {
				addr, err := netlink.ParseAddr(h.ip + "/16")
				if err != nil {
					return err
				}
				if err := netlink.AddrAdd(l, addr); err != nil {
					return fmt.Errorf("address %s: %w", addr, err)
				}
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return fmt.Errorf("set %s up: %w", name, err)
			}
		}
		return nil
	})
}

// dial connects from inside the node's netns (the agent's health and
// metrics listen on its own loopback). A socket keeps the namespace it was
// made in, so only the connect runs there.
func (h *hollow) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := h.netns.Do(func(ns.NetNS) error {
		var err error
		c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// ready reports whether the agent's /readyz answers 200.
func (h *hollow) ready(ctx context.Context) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+agentHealthAddr+"/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := h.http.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitReady polls /readyz until it answers 200, the agent exits, or ctx
// ends.
func (h *hollow) waitReady(ctx context.Context) error {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		if h.ready(ctx) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent of %s not ready: %w; its log ends:\n%s", h.name, ctx.Err(), h.agent.LogTail(10))
		case <-h.agent.Exited():
			return fmt.Errorf("agent of %s exited: %v; its log ends:\n%s", h.name, h.agent.ExitError(), h.agent.LogTail(10))
		case <-t.C:
		}
	}
}

// close stops the node's processes and removes its netns (and with it the
// veth). The Node object stays: the control plane goes with the run.
func (h *hollow) close() error {
	var errs []error
	if h.agent != nil {
		errs = append(errs, h.agent.Stop(10*time.Second))
	}
	if h.emulator != nil {
		errs = append(errs, h.emulator.Stop(5*time.Second))
	}
	if h.netns != nil {
		errs = append(errs, e2eenv.DeleteNetns(h.netns))
		h.netns = nil
	}
	return errors.Join(errs...)
}

// nsenterPath finds nsenter (util-linux).
func nsenterPath() (string, error) {
	p, err := exec.LookPath("nsenter")
	if err != nil {
		return "", fmt.Errorf("the hollow nodes need nsenter (util-linux): %w", err)
	}
	return p, nil
}

// splitArgs splits a space-separated flag list ("" → none).
func splitArgs(s string) []string { return strings.Fields(s) }
