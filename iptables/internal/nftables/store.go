package nftables

import (
	"errors"
	"fmt"
	"net/netip"

	nft "github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/iptables/internal/rules"
)

// store is the probe sets as nftables sets in the node's nat table
// (element comment = pod uid).
type store struct {
	c     *nft.Conn
	table *nft.Table
}

// Probes opens the probe-set store; close releases its socket in the
// background (see conn.close).
func (b *Backend) Probes() (rules.ProbeStore, func(), error) {
	c, err := nft.New(nft.AsLasting())
	if err != nil {
		return nil, nil, fmt.Errorf("netlink: %w", err)
	}
	return store{c: c, table: &nft.Table{Name: TableNat, Family: inet}}, func() { background(b.closing, c.CloseLasting) }, nil
}

// set names f's probe set for the library (elements only: the set itself
// is created by converge).
func (s store) set(f rules.Family) *nft.Set {
	set := &nft.Set{Table: s.table, Name: rules.ProbeSetV4, KeyType: nft.TypeIPAddr}
	if f == rules.IPv6 {
		set.Name, set.KeyType = rules.ProbeSetV6, nft.TypeIP6Addr
	}
	return set
}

func noSet(err error) error {
	if errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("%w: %w", rules.ErrNoSet, err)
	}
	return err
}

// List returns ip -> uid of f's set.
func (s store) List(f rules.Family) (map[netip.Addr]string, error) {
	set, err := s.c.GetSetByName(s.table, f.ProbeSet())
	if err != nil {
		return nil, fmt.Errorf("listing nft set %s: %w", f.ProbeSet(), noSet(err))
	}
	elems, err := s.c.GetSetElements(set)
	if err != nil {
		return nil, fmt.Errorf("listing nft set %s: %w", f.ProbeSet(), noSet(err))
	}
	out := make(map[netip.Addr]string, len(elems))
	for _, e := range elems {
		if a, ok := netip.AddrFromSlice(e.Key); ok {
			out[a.Unmap()] = e.Comment
		}
	}
	return out, nil
}

// Add puts the element in; relabelling is a delete and an add in the same
// transaction (an add of an existing element keeps its old comment).
func (s store) Add(f rules.Family, ip netip.Addr, uid string, relabel bool) error {
	set := s.set(f)
	if relabel {
		if err := s.c.SetDeleteElements(set, []nft.SetElement{{Key: ip.AsSlice()}}); err != nil {
			return err
		}
	}
	if err := s.c.SetAddElements(set, []nft.SetElement{{Key: ip.AsSlice(), Comment: uid}}); err != nil {
		return err
	}
	if err := s.c.Flush(); err != nil {
		return fmt.Errorf("adding %s (pod %s) to nft set %s: %w", ip, uid, f.ProbeSet(), noSet(err))
	}
	return nil
}

// Del removes ip from f's set.
func (s store) Del(f rules.Family, ip netip.Addr) error {
	if err := s.c.SetDeleteElements(s.set(f), []nft.SetElement{{Key: ip.AsSlice()}}); err != nil {
		return err
	}
	if err := s.c.Flush(); err != nil {
		return fmt.Errorf("removing %s from nft set %s: %w", ip, f.ProbeSet(), noSet(err))
	}
	return nil
}
