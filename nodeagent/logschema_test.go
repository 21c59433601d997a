package nodeagent_test

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/hack/sloglint/logkeys"
)

// schemaKeys are the log keys docs/agent.md ("Logging") lists, read from
// the first column of its table.
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
	key := regexp.MustCompile("`([a-z0-9_]+)`")
	var keys []string
	for line := range strings.SplitSeq(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 || !strings.HasPrefix(line, "| `") {
			continue // not a row of keys
		}
		for _, m := range key.FindAllStringSubmatch(cells[1], -1) {
			keys = append(keys, m[1])
		}
	}
	return keys
}

// TestLogSchemaIsTheLintersKeys: the log keys docs/agent.md ("Logging")
// lists are exactly the keys `make verify` (hack/sloglint, with
// hack/sloglint/logkeys) lets shipped code log. sloglint enforces the
// keys; this is the one rule it lacks: that they and the documented schema
// are the same list, so a user reading the docs knows every key a log line
// can carry.
func TestLogSchemaIsTheLintersKeys(t *testing.T) {
	allowed := logkeys.Allowed
	documented := schemaKeys(t)
	if len(allowed) == 0 || len(documented) == 0 {
		t.Fatalf("hack/sloglint/logkeys allows %d log keys, docs/agent.md lists %d: one of the readers is broken", len(allowed), len(documented))
	}
	for _, k := range documented {
		if !slices.Contains(allowed, k) {
			t.Errorf("docs/agent.md lists log key %q, which hack/sloglint/logkeys.Allowed lacks", k)
		}
	}
	for _, k := range allowed {
		if !slices.Contains(documented, k) {
			t.Errorf("hack/sloglint/logkeys allows log key %q, which docs/agent.md's Logging table does not list", k)
		}
	}
}
