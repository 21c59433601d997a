package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The installer edits CNI configs as text, not as a decoded map: a map
// would reorder keys and reformat numbers and whitespace, and the promise
// is that everything except our own entry stays byte-for-byte. So it finds
// the byte spans of the "plugins" array's elements and splices our entry in
// or out; inserting then removing gives back the exact original bytes.

// span is a half-open byte range [start, end) of one JSON value.
type span struct{ start, end int }

// listLayout is where a conflist's plugins array and its elements are.
type listLayout struct {
	open, close int // offsets of '[' and ']'
	elems       []span
}

// parseList finds the plugins array of a conflist. A file without one, or
// not a JSON object, is an error.
func parseList(data []byte) (listLayout, error) {
	var l listLayout
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return l, errors.New("not a JSON object")
	}
	found := false
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return l, fmt.Errorf("reading key: %w", err)
		}
		if key != "plugins" {
			var skip json.RawMessage
			if err := dec.Decode(&skip); err != nil {
				return l, fmt.Errorf("reading %q: %w", key, err)
			}
			continue
		}
		l, err = parsePluginsArray(dec, data)
		if err != nil {
			return l, err
		}
		found = true
	}
	if _, err := dec.Token(); err != nil {
		return l, fmt.Errorf("unterminated object: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return l, errors.New("trailing data after the object")
	}
	if !found {
		return l, errors.New(`no "plugins" array`)
	}
	return l, nil
}

func parsePluginsArray(dec *json.Decoder, data []byte) (listLayout, error) {
	var l listLayout
	if tok, err := dec.Token(); err != nil || tok != json.Delim('[') {
		return l, errors.New(`"plugins" is not an array`)
	}
	l.open = int(dec.InputOffset()) - 1
	for dec.More() {
		before := int(dec.InputOffset())
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return l, fmt.Errorf("reading plugin %d: %w", len(l.elems), err)
		}
		end := int(dec.InputOffset())
		start := skipSeparators(data, before)
		if start+len(raw) != end {
			return l, fmt.Errorf("plugin %d: unexpected layout", len(l.elems))
		}
		l.elems = append(l.elems, span{start, end})
	}
	if _, err := dec.Token(); err != nil {
		return l, fmt.Errorf(`unterminated "plugins": %w`, err)
	}
	l.close = int(dec.InputOffset()) - 1
	return l, nil
}

// skipSeparators moves past JSON whitespace and at most one comma.
func skipSeparators(data []byte, i int) int {
	comma := false
	for i < len(data) {
		switch c := data[i]; {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
		case c == ',' && !comma:
			comma = true
		default:
			return i
		}
		i++
	}
	return i
}

// pluginType reads an element's "type" ("" when it has none).
func pluginType(elem []byte) string {
	var p struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(elem, &p) // a malformed element simply has no type
	return p.Type
}

// removeEntries returns data without the plugins whose type is typ, and
// how many it removed. The separator before a removed element goes with it,
// so removal undoes appendEntry exactly.
func removeEntries(data []byte, typ string) ([]byte, int, error) {
	n := 0
	for {
		l, err := parseList(data)
		if err != nil {
			return nil, n, err
		}
		i := -1
		for j, e := range l.elems {
			if pluginType(data[e.start:e.end]) == typ {
				i = j
				break
			}
		}
		if i < 0 {
			return data, n, nil
		}
		var from, to int
		switch {
		case i > 0: // from the end of the previous element: its comma and ours go
			from, to = l.elems[i-1].end, l.elems[i].end
		case len(l.elems) > 1: // first of several: up to the next element
			from, to = l.elems[0].start, l.elems[1].start
		default: // the only one
			from, to = l.open+1, l.close
		}
		data = splice(data, from, to, nil)
		n++
	}
}

// appendEntry inserts entry (a JSON object) as the last plugin, indented like
// the element before it.
func appendEntry(data []byte, entry any) ([]byte, error) {
	l, err := parseList(data)
	if err != nil {
		return nil, err
	}
	if len(l.elems) == 0 {
		b, err := json.Marshal(entry)
		if err != nil {
			return nil, err
		}
		return splice(data, l.open+1, l.open+1, b), nil
	}
	last := l.elems[len(l.elems)-1]
	// The whitespace in front of the last element is the list's style.
	prevEnd := l.open + 1
	if len(l.elems) > 1 {
		prevEnd = l.elems[len(l.elems)-2].end
	}
	ws := bytes.TrimLeft(data[prevEnd:last.start], ",")
	indent := ""
	if k := bytes.LastIndexByte(ws, '\n'); k >= 0 {
		indent = string(ws[k+1:])
	}
	var b []byte
	if indent != "" || bytes.IndexByte(ws, '\n') >= 0 {
		b, err = json.MarshalIndent(entry, indent, "  ")
	} else {
		b, err = json.Marshal(entry)
	}
	if err != nil {
		return nil, err
	}
	ins := append([]byte{','}, ws...)
	ins = append(ins, b...)
	return splice(data, last.end, last.end, ins), nil
}

func splice(data []byte, from, to int, ins []byte) []byte {
	out := make([]byte, 0, len(data)-(to-from)+len(ins))
	out = append(out, data[:from]...)
	out = append(out, ins...)
	return append(out, data[to:]...)
}
