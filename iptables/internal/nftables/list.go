package nftables

import (
	"encoding/binary"
	"fmt"

	mnl "github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// The dumps the rule path reads on its socket.

// chainInfo is a chain as listed: family, table, name and, for a base
// chain, its hook, priority and type.
type chainInfo struct {
	family uint8
	table  string
	name   string
	hook   *uint32
	prio   int32
	typ    string
}

// listChains lists the chains of family (NFPROTO_UNSPEC: every family).
func (c *conn) listChains(family uint8) ([]chainInfo, error) {
	var out []chainInfo
	err := c.dump(unix.NFT_MSG_GETCHAIN, family, nil, func(fam uint8, attrs []byte) error {
		ch := chainInfo{family: fam}
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		ad.ByteOrder = binary.BigEndian
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_CHAIN_TABLE:
				ch.table = ad.String()
			case unix.NFTA_CHAIN_NAME:
				ch.name = ad.String()
			case unix.NFTA_CHAIN_TYPE:
				ch.typ = ad.String()
			case unix.NFTA_CHAIN_HOOK:
				ad.Nested(func(h *mnl.AttributeDecoder) error {
					for h.Next() {
						switch h.Type() {
						case unix.NFTA_HOOK_HOOKNUM:
							n := h.Uint32()
							ch.hook = &n
						case unix.NFTA_HOOK_PRIORITY:
							ch.prio = int32(h.Uint32())
						}
					}
					return nil
				})
			}
		}
		if err := ad.Err(); err != nil {
			return err
		}
		out = append(out, ch)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing nftables chains: %w", err)
	}
	return out, nil
}

// listTables lists the names of the inet tables.
func (c *conn) listTables() ([]string, error) {
	var out []string
	err := c.dump(unix.NFT_MSG_GETTABLE, unix.NFPROTO_INET, nil, func(_ uint8, attrs []byte) error {
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		for ad.Next() {
			if ad.Type() == unix.NFTA_TABLE_NAME {
				out = append(out, ad.String())
			}
		}
		return ad.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("listing inet tables: %w", err)
	}
	return out, nil
}

// listSets lists the names of the sets of an inet table.
func (c *conn) listSets(table string) ([]string, error) {
	filter, err := mnl.MarshalAttributes([]mnl.Attribute{{Type: unix.NFTA_SET_TABLE, Data: append([]byte(table), 0)}})
	if err != nil {
		return nil, err
	}
	var out []string
	err = c.dump(unix.NFT_MSG_GETSET, unix.NFPROTO_INET, filter, func(_ uint8, attrs []byte) error {
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		var name, tbl string
		for ad.Next() {
			switch ad.Type() {
			case unix.NFTA_SET_NAME:
				name = ad.String()
			case unix.NFTA_SET_TABLE:
				tbl = ad.String()
			}
		}
		if tbl == table {
			out = append(out, name)
		}
		return ad.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("listing sets of %s: %w", table, err)
	}
	return out, nil
}

// dumpRules calls fn for every rule of the inet family (one dump; the
// library dumps one chain per request).
func (c *conn) dumpRules(fn func(attrs []byte) error) error {
	err := c.dump(unix.NFT_MSG_GETRULE, unix.NFPROTO_INET, nil, func(_ uint8, attrs []byte) error { return fn(attrs) })
	if err != nil {
		return fmt.Errorf("dumping inet rules: %w", err)
	}
	return nil
}

// setElems returns the keys of the elements of a set of an inet table.
func (c *conn) setElems(table, set string) ([][]byte, error) {
	filter, err := mnl.MarshalAttributes([]mnl.Attribute{
		{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: append([]byte(table), 0)},
		{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: append([]byte(set), 0)},
	})
	if err != nil {
		return nil, err
	}
	var out [][]byte
	err = c.dump(unix.NFT_MSG_GETSETELEM, unix.NFPROTO_INET, filter, func(_ uint8, attrs []byte) error {
		ad, err := mnl.NewAttributeDecoder(attrs)
		if err != nil {
			return err
		}
		for ad.Next() {
			if ad.Type() != unix.NFTA_SET_ELEM_LIST_ELEMENTS {
				continue
			}
			ad.Nested(func(list *mnl.AttributeDecoder) error {
				for list.Next() {
					list.Nested(func(el *mnl.AttributeDecoder) error {
						for el.Next() {
							if el.Type() != unix.NFTA_SET_ELEM_KEY {
								continue
							}
							el.Nested(func(k *mnl.AttributeDecoder) error {
								for k.Next() {
									if k.Type() == unix.NFTA_DATA_VALUE {
										out = append(out, append([]byte(nil), k.Bytes()...))
									}
								}
								return nil
							})
						}
						return nil
					})
				}
				return nil
			})
		}
		return ad.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("listing the elements of set %s of %s: %w", set, table, err)
	}
	return out, nil
}
