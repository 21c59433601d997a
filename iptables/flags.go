package iptables

import (
	"errors"
	"flag"
	"strconv"
	"time"
)

// RegisterFlags binds the node-wide rule settings an operator chooses to
// their flags on fs, with their defaults as values. IPv6, StateDir and
// HostProc are the agent's settings (the caller copies them).
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	fs.StringVar((*string)(&c.Mode), "iptables", string(ModeAuto), "rules backend: auto, legacy, nft (iptables-nft) or nftables (native, over netlink)")
	c.LockWait = DefaultLockWait
	fs.Var(lockWait{&c.LockWait}, "iptables-lock-wait", "how long (a `duration`, 1s to 1m) iptables-restore waits for the host-wide xtables lock (legacy iptables; rounded up to whole seconds) before the rule step fails and is retried")
	fs.Var(kubeletUID{&c.KubeletUID}, "kubelet-uid", "`uid` of the kubelet, whose probes the nftables backend's host SNAT matches (meta skuid); empty = found by scanning --host-proc for kubelet, kubelite or k3s")
}

// DefaultLockWait is how long iptables-restore waits for the xtables lock
// unless told otherwise.
const DefaultLockWait = 10 * time.Second

// lockWait is --iptables-lock-wait: 0 would mean the default to a caller in
// Go; on the command line it is refused with every other value out of
// bounds.
type lockWait struct{ d *time.Duration }

func (l lockWait) String() string {
	if l.d == nil {
		return ""
	}
	return l.d.String()
}

func (l lockWait) Get() any { return *l.d }
func (l lockWait) Set(s string) error {
	d, err := time.ParseDuration(s)
	if err != nil || d < time.Second || d > time.Minute {
		return errors.New("want a duration from 1s to 1m")
	}
	*l.d = d
	return nil
}

// kubeletUID is --kubelet-uid: empty (nil: scan) or a numeric uid.
type kubeletUID struct{ uid **uint32 }

func (k kubeletUID) String() string {
	if k.uid == nil || *k.uid == nil {
		return ""
	}
	return strconv.FormatUint(uint64(**k.uid), 10)
}

func (k kubeletUID) Get() any { return *k.uid }
func (k kubeletUID) Set(s string) error {
	if s == "" {
		*k.uid = nil
		return nil
	}
	u, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return errors.New("must be a numeric uid")
	}
	v := uint32(u)
	*k.uid = &v
	return nil
}
