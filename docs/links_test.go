// Package docs holds the checks that keep the tree as its documentation
// says: every relative link in README.md and docs/ leads to a file (and
// heading) that exists, every repository path the docs name in code spans
// exists (this file), and no test file is over 600 lines (testsize_test.go;
// docs/tests.md). `make verify` runs them.
package docs

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// root is the repository, seen from this package's directory.
const root = ".."

var (
	// [text](target) and ![alt](target); the target ends at a space (a
	// title) or the closing parenthesis.
	linkRe = regexp.MustCompile(`!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeRe = regexp.MustCompile("`([^`]+)`")
	// A Go identifier after a package path: `test/infra/kubetest.Wrap`.
	symbolRe   = regexp.MustCompile(`^(.*)\.[A-Za-z_][A-Za-z0-9_]*$`)
	headingRe  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	lineSuffix = regexp.MustCompile(`:\d+(-\d+)?$`)
)

// TestDocLinks fails on every relative link whose file or heading does not
// exist and on every repository path named in a code span that does not.
func TestDocLinks(t *testing.T) {
	files := docFiles(t)
	anchors := map[string][]string{} // file → its headings' anchors
	for _, f := range files {
		anchors[f] = headingAnchors(readLines(t, f))
	}
	tops := topLevel(t)
	var broken []string
	for _, f := range files {
		broken = append(broken, problems(f, readLines(t, f), anchors, tops)...)
	}
	if len(broken) > 0 {
		t.Errorf("%d broken references in the docs:\n%s", len(broken), strings.Join(broken, "\n"))
	}
}

// docFiles is README.md and every Markdown file under docs/, relative to
// root.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"README.md"}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(path, ".md") {
			rel, err := filepath.Rel(root, path)
			if err != nil {
				return err
			}
			files = append(files, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// topLevel lists the repository's top-level entries: a code span that
// starts with one of them and a slash names a repository path.
func topLevel(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && !strings.HasPrefix(e.Name(), ".") && e.Name() != "bin" {
			out = append(out, e.Name())
		}
	}
	return out
}

func readLines(t *testing.T, rel string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(string(b), "\n")
}

// problems lists what is broken in file f (lines given), each as
// "file:line: what".
func problems(f string, lines []string, anchors map[string][]string, tops []string) []string {
	var out []string
	inFence := false
	for i, line := range lines {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		at := fmt.Sprintf("%s:%d", f, i+1)
		prose := codeRe.ReplaceAllString(line, "")
		for _, m := range linkRe.FindAllStringSubmatch(prose, -1) {
			if p := checkLink(f, m[1], anchors); p != "" {
				out = append(out, at+": "+p)
			}
		}
		for _, m := range codeRe.FindAllStringSubmatch(line, -1) {
			if p := checkPath(m[1], tops); p != "" {
				out = append(out, at+": "+p)
			}
		}
	}
	return out
}

// checkLink checks one link target of file f; absolute URLs are not its
// business.
func checkLink(f, target string, anchors map[string][]string) string {
	if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
		return ""
	}
	file, anchor, _ := strings.Cut(target, "#")
	dest := f
	if file != "" {
		dest = filepath.Clean(filepath.Join(filepath.Dir(f), file))
		if _, err := os.Stat(filepath.Join(root, dest)); err != nil {
			return fmt.Sprintf("link %q: %s does not exist", target, dest)
		}
	}
	if anchor == "" || !strings.HasSuffix(dest, ".md") {
		return ""
	}
	if !slices.Contains(anchors[dest], anchor) {
		return fmt.Sprintf("link %q: %s has no heading #%s", target, dest, anchor)
	}
	return ""
}

// checkPath checks a code span that names a repository path: its first
// word, without a line number, a trailing "..." ("…") or slash, or a Go symbol
// after a package path. Spans with placeholders or globs are skipped.
func checkPath(span string, tops []string) string {
	word := strings.Fields(span + " ")[0]
	top, _, ok := strings.Cut(word, "/")
	if !ok || !slices.Contains(tops, top) || strings.ContainsAny(word, "*<>{}$") {
		return ""
	}
	p := lineSuffix.ReplaceAllString(word, "")
	p = strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(p, "..."), "…"), "/")
	if exists(p) {
		return ""
	}
	if m := symbolRe.FindStringSubmatch(p); m != nil && exists(m[1]) {
		return "" // package path and a symbol in it
	}
	return fmt.Sprintf("path %q does not exist", word)
}

func exists(rel string) bool {
	_, err := os.Stat(filepath.Join(root, rel))
	return err == nil
}

// headingAnchors are the anchors GitHub gives a file's headings: lower
// case, punctuation other than '-' and '_' dropped, spaces as '-', a
// repeated anchor suffixed -1, -2, ...
func headingAnchors(lines []string) []string {
	var out []string
	seen := map[string]int{}
	inFence := false
	for _, line := range lines {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			inFence = !inFence
			continue
		}
		m := headingRe.FindStringSubmatch(line)
		if inFence || m == nil {
			continue
		}
		a := slug(m[1])
		if n := seen[a]; n > 0 {
			out = append(out, fmt.Sprintf("%s-%d", a, n))
		} else {
			out = append(out, a)
		}
		seen[a]++
	}
	return out
}

func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
