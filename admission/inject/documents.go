package inject

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"

	"sigs.k8s.io/kustomize/kyaml/yaml"
)

// document is a piece of the input: text written back as it is unless node
// (nil for separators, comments and empty documents) changed.
type document struct {
	text   string
	node   *yaml.RNode
	render func(*yaml.RNode) (string, error)
}

// separator is a YAML document separator line.
var separator = regexp.MustCompile(`^---(\s.*)?$`)

// splitYAML cuts a YAML stream at its separator lines; separators, and
// documents holding only comments, are kept as text.
func splitYAML(in []byte) ([]*document, error) {
	var docs []*document
	var cur strings.Builder
	flush := func() error {
		text := cur.String()
		cur.Reset()
		if text == "" {
			return nil
		}
		d := &document{text: text}
		node, err := yaml.Parse(text)
		switch {
		case errors.Is(err, io.EOF):
		case err != nil:
			return fmt.Errorf("document %d: not YAML: %w", len(docs)+1, err)
		case !yaml.IsMissingOrNull(node) && node.YNode().Kind == yaml.MappingNode:
			d.node = node
			trailing := text[len(strings.TrimRight(text, "\n")):]
			// Lists stay indented as the author wrote them.
			style := yaml.SequenceIndentStyle(yaml.DeriveSeqIndentStyle(text))
			d.render = func(n *yaml.RNode) (string, error) {
				var b bytes.Buffer
				e := yaml.NewEncoderWithOptions(&b, &yaml.EncoderOptions{SeqIndent: style})
				if err := e.Encode(n.Document()); err != nil {
					return "", err
				}
				if err := e.Close(); err != nil {
					return "", err
				}
				return strings.TrimRight(b.String(), "\n") + trailing, nil
			}
		}
		docs = append(docs, d)
		return nil
	}
	for _, line := range strings.SplitAfter(string(in), "\n") {
		if separator.MatchString(strings.TrimRight(line, "\r\n")) {
			if err := flush(); err != nil {
				return nil, err
			}
			docs = append(docs, &document{text: line})
			continue
		}
		cur.WriteString(line)
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return docs, nil
}

// splitJSON reads a stream of JSON values; the text between them
// (whitespace) is kept.
func splitJSON(in []byte) ([]*document, error) {
	dec := json.NewDecoder(bytes.NewReader(in))
	var docs []*document
	var off int64
	for {
		var raw json.RawMessage
		err := dec.Decode(&raw)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("value %d: not JSON: %w", len(docs)+1, err)
		}
		end := dec.InputOffset()
		start := end - int64(len(raw))
		if start > off {
			docs = append(docs, &document{text: string(in[off:start])})
		}
		d := &document{text: string(raw)}
		node, err := yaml.Parse(string(raw)) // JSON is YAML; key order kept
		if err != nil {
			return nil, fmt.Errorf("value %d: %w", len(docs)+1, err)
		}
		if node.YNode().Kind == yaml.MappingNode {
			d.node = node
			d.render = func(n *yaml.RNode) (string, error) {
				var b strings.Builder
				err := writeJSON(&b, n.YNode(), "")
				return b.String(), err
			}
		}
		docs = append(docs, d)
		off = end
	}
	docs = append(docs, &document{text: string(in[off:])})
	return docs, nil
}

// writeJSON writes a YAML node parsed from JSON back as indented JSON,
// keeping the key order of the input.
func writeJSON(b *strings.Builder, n *yaml.Node, indent string) error {
	inner := indent + "  "
	switch n.Kind {
	case yaml.DocumentNode:
		return writeJSON(b, n.Content[0], indent)
	case yaml.MappingNode:
		if len(n.Content) == 0 {
			b.WriteString("{}")
			return nil
		}
		b.WriteString("{\n")
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, _ := json.Marshal(n.Content[i].Value)
			b.WriteString(inner)
			b.Write(k)
			b.WriteString(": ")
			if err := writeJSON(b, n.Content[i+1], inner); err != nil {
				return err
			}
			if i+2 < len(n.Content) {
				b.WriteString(",")
			}
			b.WriteString("\n")
		}
		b.WriteString(indent + "}")
	case yaml.SequenceNode:
		if len(n.Content) == 0 {
			b.WriteString("[]")
			return nil
		}
		b.WriteString("[\n")
		for i, c := range n.Content {
			b.WriteString(inner)
			if err := writeJSON(b, c, inner); err != nil {
				return err
			}
			if i+1 < len(n.Content) {
				b.WriteString(",")
			}
			b.WriteString("\n")
		}
		b.WriteString(indent + "]")
	case yaml.ScalarNode:
		switch n.Tag {
		case yaml.NodeTagString, "":
			s, _ := json.Marshal(n.Value)
			b.Write(s)
		case yaml.NodeTagInt, yaml.NodeTagFloat, yaml.NodeTagBool, yaml.NodeTagNull:
			b.WriteString(n.Value)
		default:
			return fmt.Errorf("JSON value %q of type %s", n.Value, n.Tag)
		}
	default:
		return fmt.Errorf("unexpected YAML node kind %d in JSON", n.Kind)
	}
	return nil
}
