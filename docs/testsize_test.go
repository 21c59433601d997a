package docs

import (
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"
	"testing/fstest"
)

// maxTestLines is the most lines a _test.go file may have (docs/tests.md,
// "Writing a test"): a longer one holds more than one subject and its
// helpers are lost among its tests; split it by subject (or, in a suite of
// ordered steps, one file per step) with the helpers in a file of their own.
const maxTestLines = 600

// oversizedTests are the test files still over maxTestLines, each waiting
// to be split. The list only shrinks: a listed file that is split (or
// moved) fails the check until it leaves the list, and no file joins it.
var oversizedTests = []string{
	"cniinstall/install_test.go",
	"nodeagent/agent/agent_test.go",
	"nodeagent/ztunnel/server_test.go",
}

// TestTestFilesSmall fails naming every _test.go file in the repository
// (the nested test-only modules included) over maxTestLines lines.
func TestTestFilesSmall(t *testing.T) {
	lines, err := testFileLines(os.DirFS(root))
	if err != nil {
		t.Fatal(err)
	}
	if len(lines) == 0 {
		t.Fatalf("no _test.go file found under %s", root)
	}
	if p := sizeProblems(lines, maxTestLines, oversizedTests); len(p) > 0 {
		t.Errorf("%d test files break the %d-line rule:\n%s", len(p), maxTestLines, strings.Join(p, "\n"))
	}
}

// testFileLines counts the lines of every _test.go file in fsys, skipping
// hidden directories (.git, .cache: prebuilt binaries and Go's caches),
// bin/ and testdata/ (fixtures, not tests).
func testFileLines(fsys fs.FS) (map[string]int, error) {
	lines := map[string]int{}
	err := fs.WalkDir(fsys, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "bin" || d.Name() == "testdata") {
				return fs.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := fs.ReadFile(fsys, path)
		if err != nil {
			return err
		}
		lines[path] = bytes.Count(b, []byte("\n"))
		return nil
	})
	return lines, err
}

// sizeProblems names each file over max lines that is not listed in known,
// and each file in known that is no longer over max (or no longer exists),
// sorted.
func sizeProblems(lines map[string]int, max int, known []string) []string {
	var out []string
	for path, n := range lines {
		if n > max && !slices.Contains(known, path) {
			out = append(out, fmt.Sprintf("%s: %d lines, over %d: split it", path, n, max))
		}
	}
	for _, path := range known {
		n, ok := lines[path]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("%s: listed in oversizedTests but not found: take it off the list", path))
		case n <= max:
			out = append(out, fmt.Sprintf("%s: %d lines, within %d now: take it off oversizedTests", path, n, max))
		}
	}
	slices.Sort(out)
	return out
}

// TestSizeProblems: the check names a file one line over the limit, passes
// one at the limit, skips the trees it must skip, and holds the known list
// to the tree.
func TestSizeProblems(t *testing.T) {
	text := func(n int) *fstest.MapFile { return &fstest.MapFile{Data: []byte(strings.Repeat("x\n", n))} }
	fsys := fstest.MapFS{
		"a/at_test.go":           text(600),
		"a/over_test.go":         text(601),
		"a/over.go":              text(900), // not a test
		"b/known_test.go":        text(700),
		"b/split_test.go":        text(100),
		".cache/mod/x/y_test.go": text(900),
		"bin/z_test.go":          text(900),
		"c/testdata/f_test.go":   text(900),
		"test/helm/big_test.go":  text(650), // a nested module counts
	}
	lines, err := testFileLines(fsys)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"a/at_test.go": 600, "a/over_test.go": 601, "b/known_test.go": 700, "b/split_test.go": 100, "test/helm/big_test.go": 650}
	if fmt.Sprint(lines) != fmt.Sprint(want) {
		t.Errorf("counted %v, want %v", lines, want)
	}
	for _, c := range []struct {
		name  string
		known []string
		want  []string
	}{
		{"nothing known", nil, []string{
			"a/over_test.go: 601 lines, over 600: split it",
			"b/known_test.go: 700 lines, over 600: split it",
			"test/helm/big_test.go: 650 lines, over 600: split it",
		}},
		{"known ones pass, stale ones are named", []string{"a/over_test.go", "b/known_test.go", "test/helm/big_test.go", "b/split_test.go", "gone_test.go"}, []string{
			"b/split_test.go: 100 lines, within 600 now: take it off oversizedTests",
			"gone_test.go: listed in oversizedTests but not found: take it off the list",
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := sizeProblems(lines, 600, c.known); !slices.Equal(got, c.want) {
				t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
			}
		})
	}
}
