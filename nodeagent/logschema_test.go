package nodeagent_test

import (
	"bytes"
	"go/ast"
	"go/parser"
	"go/printer"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// shippedDirs hold the shipped code (what cmd/ambientd and
// cmd/ambientd-cni link of ours, and more).
var shippedDirs = []string{"cmd/ambientd", "cmd/ambientd-cni", "cniplugin", "cniapi", "nodeagent", "iptables", "ztunnelproto", "admission"}

// logCall is one slog call of shipped code with its literal keys.
type logCall struct {
	pos  string
	keys []logKey
}

type logKey struct {
	key   string
	value ast.Expr
}

// loggerRecv matches the receivers of slog calls: a logger variable or
// field (log, a.log, r.i.log), a helper returning one (a.podLog(...)), or
// the slog package.
var loggerRecv = regexp.MustCompile(`(^|\.)log$|Log\(|^slog$`)

// logCalls parses the shipped code (tests excluded) and returns its slog
// calls: Debug/Info/Warn/Error(msg, key, value, ...), their Context forms,
// and With(key, value, ...).
func logCalls(t *testing.T) []logCall {
	t.Helper()
	fset := token.NewFileSet()
	var calls []logCall
	for _, dir := range shippedDirs {
		err := filepath.WalkDir(filepath.Join("..", dir), func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, parser.SkipObjectResolution)
			if err != nil {
				return err
			}
			ast.Inspect(f, func(n ast.Node) bool {
				c, ok := n.(*ast.CallExpr)
				if !ok {
					return true
				}
				sel, ok := c.Fun.(*ast.SelectorExpr)
				if !ok {
					return true
				}
				first := 1
				switch sel.Sel.Name {
				case "Debug", "Info", "Warn", "Error":
				case "DebugContext", "InfoContext", "WarnContext", "ErrorContext":
					first = 2
				case "With":
					first = 0
				default:
					return true
				}
				var recv bytes.Buffer
				printer.Fprint(&recv, fset, sel.X)
				if !loggerRecv.MatchString(recv.String()) {
					return true
				}
				lc := logCall{pos: fset.Position(c.Pos()).String()}
				for i := first; i+1 < len(c.Args); i += 2 {
					lit, ok := c.Args[i].(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						break // an attr or a slice of them: not key-value pairs
					}
					k, _ := strconv.Unquote(lit.Value)
					lc.keys = append(lc.keys, logKey{k, c.Args[i+1]})
				}
				calls = append(calls, lc)
				return true
			})
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return calls
}

// schemaKeys are the log keys docs/agent.md ("Logging") lists, read from
// its table.
func schemaKeys(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../docs/agent.md")
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(b), "\n## Logging\n")
	if !ok {
		t.Fatal(`docs/agent.md has no "## Logging" section`)
	}
	section, _, _ := strings.Cut(after, "\n## ")
	var keys []string
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 || !strings.HasPrefix(line, "| `") {
			continue // not a row of keys
		}
		for _, m := range regexp.MustCompile("`([a-z0-9_]+)`").FindAllStringSubmatch(cells[1], -1) {
			keys = append(keys, m[1])
		}
	}
	if len(keys) == 0 {
		t.Fatal("docs/agent.md's Logging section lists no keys")
	}
	return keys
}

// errorValue matches a value that is an error: err, openErr, perr, an
// Error() call.
var errorValue = regexp.MustCompile(`(^|[a-z])[eE]rr$|\.Error\(\)$|^errors\.`)

// TestLogSchema: shipped code logs with one schema (docs/agent.md,
// "Logging"): every key is snake_case; every key is a documented one or
// ends in a documented suffix; an error is logged as "error" (or
// "<what>_error"), never "err" or anything else; a pod is "namespace",
// "pod" (its name) and "uid", never "namespace/name" in one key; and every
// documented key is in use.
func TestLogSchema(t *testing.T) {
	documented := schemaKeys(t)
	var suffixes []string
	for _, k := range documented {
		if strings.HasPrefix(k, "_") {
			suffixes = append(suffixes, k)
		}
	}
	snake := regexp.MustCompile(`^[a-z][a-z0-9_]*$`)
	used := map[string]bool{}
	calls := logCalls(t)
	if len(calls) < 100 {
		t.Fatalf("found %d slog calls in shipped code; the scan is broken", len(calls))
	}
	for _, c := range calls {
		for _, kv := range c.keys {
			var val bytes.Buffer
			printer.Fprint(&val, token.NewFileSet(), kv.value)
			v := val.String()
			used[kv.key] = true
			for _, s := range suffixes {
				if strings.HasSuffix(kv.key, s) {
					used[s] = true
				}
			}
			switch {
			case !snake.MatchString(kv.key):
				t.Errorf("%s: log key %q is not snake_case", c.pos, kv.key)
			case !slices.Contains(documented, kv.key) && !slices.ContainsFunc(suffixes, func(s string) bool { return strings.HasSuffix(kv.key, s) }):
				t.Errorf("%s: log key %q is not in docs/agent.md's schema (Logging): use a listed key or list it", c.pos, kv.key)
			case errorValue.MatchString(v) && kv.key != "error" && !strings.HasSuffix(kv.key, "_error"):
				t.Errorf("%s: error %s logged as %q: the schema's key for an error is \"error\"", c.pos, v, kv.key)
			case kv.key == "pod" && strings.Contains(v, `"/"`):
				t.Errorf("%s: \"pod\" is the pod's name (its namespace is \"namespace\"), not %s", c.pos, v)
			}
		}
	}
	for _, k := range documented {
		if !used[k] {
			t.Errorf("docs/agent.md lists log key %q, which shipped code does not use", k)
		}
	}
}
