package sizerule

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// root is the repository, seen from this package's directory.
const root = "../.."

// notShipped are the trees whose Go files are no part of the binaries.
var notShipped = []string{"test", "hack", ".cache"}

// TestShippedCodeSize: every shipped Go file has at most MaxFileLines
// lines and every function (and method) at most MaxFuncLines, from its
// doc-less `func` line to its closing brace. The failure names each file
// and function over, with its size.
func TestShippedCodeSize(t *testing.T) {
	fset := token.NewFileSet()
	files := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || slices.Contains(notShipped, rel)) {
				return filepath.SkipDir
			}
			return nil
		}
		if !shipped(rel) {
			return nil
		}
		files++
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if n := fset.File(f.Pos()).LineCount(); n > MaxFileLines {
			t.Errorf("%s: %d lines, want at most %d: split it by what its parts do", rel, n, MaxFileLines)
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			start, end := fset.Position(fn.Type.Pos()).Line, fset.Position(fn.Body.Rbrace).Line
			if n := end - start + 1; n > MaxFuncLines {
				t.Errorf("%s:%d: func %s: %d lines, want at most %d", rel, start, funcName(fn), n, MaxFuncLines)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// A walk that found nothing (a moved root) would pass anything.
	if files < 100 {
		t.Fatalf("found %d shipped Go files, want the tree's 100 or more", files)
	}
}

// shipped reports whether the file at rel (slash-separated, from the
// repository root) is shipped Go code.
func shipped(rel string) bool {
	return strings.HasSuffix(rel, ".go") && !strings.HasSuffix(rel, "_test.go") && !strings.HasSuffix(rel, ".pb.go")
}

// funcName is fn's name, a method's as Type.Method.
func funcName(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return fn.Name.Name
	}
	t := fn.Recv.List[0].Type
	for {
		switch x := t.(type) {
		case *ast.StarExpr:
			t = x.X
			continue
		case *ast.IndexExpr:
			t = x.X
			continue
		case *ast.IndexListExpr:
			t = x.X
			continue
		case *ast.Ident:
			return x.Name + "." + fn.Name.Name
		}
		return fn.Name.Name
	}
}
