package inject

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ambientd/ambientd/admission"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// options are the command lines of the golden files: -n tenant and
// --ambient-namespaces tenant.
func options(warn *[]string) Options {
	return Options{
		Settings:  admission.DefaultSettings(),
		Namespace: "tenant",
		NamespaceLabels: func(ns string) (map[string]string, bool) {
			if ns == "tenant" {
				return map[string]string{"istio.io/dataplane-mode": "ambient"}, true
			}
			return nil, false
		},
		Warn: func(m string) { *warn = append(*warn, m) },
	}
}

// TestGolden: each testdata/*.in.* injected equals its .golden file;
// injecting the output again changes nothing (inject | inject == inject);
// every kind inject handles got the gate in at least one file.
func TestGolden(t *testing.T) {
	ins, err := filepath.Glob("testdata/*.in.*")
	if err != nil || len(ins) == 0 {
		t.Fatalf("no golden inputs: %v", err)
	}
	injectedKinds := map[string]bool{}
	for _, in := range ins {
		t.Run(filepath.Base(in), func(t *testing.T) {
			src, err := os.ReadFile(in)
			if err != nil {
				t.Fatal(err)
			}
			var warns []string
			var out bytes.Buffer
			res, err := Inject(bytes.NewReader(src), &out, options(&warns))
			if err != nil {
				t.Fatal(err)
			}
			golden := strings.Replace(in, ".in.", ".golden.", 1)
			if *update {
				if err := os.WriteFile(golden, out.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out.Bytes(), want) {
				t.Errorf("output differs from %s (go test -update to accept):\n%s", golden, out.String())
			}
			var again bytes.Buffer
			if _, err := Inject(bytes.NewReader(out.Bytes()), &again, options(new([]string))); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again.Bytes(), out.Bytes()) {
				t.Errorf("not idempotent: the second pass changed the output:\n%s", again.String())
			}
			for _, tm := range res.Templates {
				if tm.Decision.AddGate {
					injectedKinds[tm.Kind] = true
				}
			}
			t.Logf("%d templates, %d injected; warnings %q", len(res.Templates), res.Injected(), warns)
			if strings.HasSuffix(in, ".json") && !slices.ContainsFunc(warns, func(w string) bool { return strings.Contains(w, "namespace elsewhere: labels unknown") }) {
				t.Errorf("no warning about the unknown namespace elsewhere: %q", warns)
			}
		})
	}
	for _, k := range Kinds() {
		if !injectedKinds[k] {
			t.Errorf("kind %s never got the gate in the golden files", k)
		}
	}
}

// TestUntouchedBytes: a stream where nothing belongs in the mesh comes out
// byte for byte as it went in (odd spacing, comments, separators, CRLF).
func TestUntouchedBytes(t *testing.T) {
	in := "--- # first\r\napiVersion: v1\r\nkind: Pod\r\nmetadata: {name: a,   namespace: plain}\r\nspec: {containers: [{name: c, image: x}]}\r\n---\n\n# just a comment\n---\n{\"not\": \"a k8s object\"}\n"
	var out bytes.Buffer
	res, err := Inject(strings.NewReader(in), &out, options(new([]string)))
	if err != nil {
		t.Fatal(err)
	}
	if out.String() != in || len(res.Templates) != 1 || res.Injected() != 0 {
		t.Errorf("got %q (%d templates, %d injected), want the input unchanged", out.String(), len(res.Templates), res.Injected())
	}
}

// TestBadInput: malformed input is an error naming the document, and
// nothing is written.
func TestBadInput(t *testing.T) {
	for name, in := range map[string]string{
		"yaml":          "apiVersion: v1\nkind: Pod\n---\nkey: [unclosed\n",
		"json":          `{"kind": "Pod", "metadata": {`,
		"bad template":  "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {hostNetwork: sometimes}\n",
		"bad namespace": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec: {template: {metadata: {labels: [a, b]}}}\n",
	} {
		t.Run(name, func(t *testing.T) {
			var out bytes.Buffer
			_, err := Inject(strings.NewReader(in), &out, options(new([]string)))
			if err == nil || out.Len() != 0 {
				t.Errorf("err %v, output %q: want an error and no output", err, out.String())
			}
			t.Log(err)
		})
	}
}
