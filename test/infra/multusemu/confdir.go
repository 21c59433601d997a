package multusemu

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// What tests of the conf dir's writers look at: the config files, when
// they stop changing, and what one ADD runs through a config with Multus.

// confExtensions are the files a runtime (libcni) reads as configs.
var confExtensions = []string{".conf", ".conflist", ".json"}

// Snapshot is every config file of dir, name → text.
func Snapshot(dir string) (map[string]string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, e := range entries {
		if !slices.Contains(confExtensions, filepath.Ext(e.Name())) {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			continue // replaced meanwhile: the next look sees it
		}
		out[e.Name()] = string(b)
	}
	return out, nil
}

// WaitFixedPoint waits until dir's config files have not changed for
// quiet, at most within (plus quiet) from now, and returns how long after
// the call they last changed, and the files then.
func WaitFixedPoint(dir string, within, quiet time.Duration) (time.Duration, map[string]string, error) {
	start := time.Now()
	last, err := Snapshot(dir)
	if err != nil {
		return 0, nil, err
	}
	since := start
	for time.Since(start) < within+quiet {
		time.Sleep(50 * time.Millisecond)
		now, err := Snapshot(dir)
		if err != nil {
			return 0, nil, err
		}
		if !equal(now, last) {
			last, since = now, time.Now()
			continue
		}
		if time.Since(since) >= quiet {
			return since.Sub(start), now, nil
		}
	}
	return 0, last, fmt.Errorf("the conf dir %s still changes %s after the start; last:\n%s", dir, within, Dump(last))
}

func equal(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// Dump prints files in name order.
func Dump(files map[string]string) string {
	var b strings.Builder
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		b.WriteString("== " + n + "\n" + files[n] + "\n")
	}
	return b.String()
}

// Expand is what one ADD runs through a config: its plugins in order, a
// Multus plugin replaced by what it runs (its delegates, each a config or
// a conflist), marked "multus(" … ")".
func Expand(conf map[string]any) []string {
	plugins, ok := conf["plugins"].([]any)
	if !ok {
		plugins = []any{conf}
	}
	var out []string
	for _, p := range plugins {
		pm, _ := p.(map[string]any)
		typ, _ := pm["type"].(string)
		if typ != "multus" {
			out = append(out, typ)
			continue
		}
		out = append(out, "multus(")
		ds, _ := pm["delegates"].([]any)
		for _, d := range ds {
			dm, _ := d.(map[string]any)
			out = append(out, Expand(dm)...)
		}
		out = append(out, ")")
	}
	return out
}

// ExpandText is Expand of a config's text (nil when it does not decode).
func ExpandText(text string) []string {
	var v map[string]any
	if json.Unmarshal([]byte(text), &v) != nil {
		return nil
	}
	return Expand(v)
}

// Nested reports a Multus that runs inside a Multus in an expanded chain.
func Nested(chain []string) bool {
	depth := 0
	for _, p := range chain {
		switch p {
		case "multus(":
			if depth++; depth > 1 {
				return true
			}
		case ")":
			depth--
		}
	}
	return false
}

// Plugins is an expanded chain without Multus's markers: the plugins one
// ADD runs, in order.
func Plugins(chain []string) []string {
	return slices.DeleteFunc(slices.Clone(chain), func(s string) bool { return s == "multus(" || s == ")" })
}
