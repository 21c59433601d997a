package bundle

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"io"
	"strings"
	"testing"
	"time"
)

// untar returns the archive's files by name (without the top directory).
func untar(t *testing.T, b []byte) map[string]string {
	t.Helper()
	gz, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		_, name, _ := strings.Cut(h.Name, "/")
		files[name] = string(data)
	}
}

// TestRedact: every form a credential takes in collected text is
// replaced, and the text around it, and values that only look alike
// (a token's lifetime), are kept.
func TestRedact(t *testing.T) {
	jwt := "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJl"
	tests := []struct{ in, want string }{
		{"Authorization: Bearer abc.def-123", "Authorization: Bearer [REDACTED]"},
		{"users:\n- name: x\n  user:\n    token: s3cr3t\n", "users:\n- name: x\n  user:\n    token: \"[REDACTED]\"\n"},
		{`{"token": "s3cr3t", "name": "k8s-pod-network"}`, `{"token": "[REDACTED]", "name": "k8s-pod-network"}`},
		{`{"kubernetes":{"token":"s3cr3t"}}`, `{"kubernetes":{"token":"[REDACTED]"}}`},
		{"client-key-data: LS0tLS1CRUdJTg==\n", "client-key-data: \"[REDACTED]\"\n"},
		{"DB_PASSWORD=hunter2 next", "DB_PASSWORD=\"[REDACTED]\" next"},
		{"--api-key=xyz", "--api-key=\"[REDACTED]\""},
		{"value " + jwt + " end", "value [REDACTED] end"},
		{"--cni-plugin-token-ttl=\"24h0m0s\"", "--cni-plugin-token-ttl=\"24h0m0s\""},
		{"ambientd_cni_plugin_token_expiry_seconds 1.7e+09", "ambientd_cni_plugin_token_expiry_seconds 1.7e+09"},
		{`{"tokenTTL": "24h"}`, `{"tokenTTL": "24h"}`},
	}
	for _, tt := range tests {
		if got := string(Redact([]byte(tt.in))); got != tt.want {
			t.Errorf("Redact(%q)\n got %q\nwant %q", tt.in, got, tt.want)
		}
	}
}

// TestArchiveBounds: a file over the per-file cap is cut and says so in
// itself and in the manifest; once the total cap is reached, files are
// left out and the manifest names them; the archive's files never add up
// to more than the total cap (plus the truncation markers).
func TestArchiveBounds(t *testing.T) {
	var buf bytes.Buffer
	lim := Limits{MaxFileBytes: 1000, MaxTotalBytes: 2500}
	a := NewArchive(&buf, "b", lim, time.Unix(0, 0))
	a.Add("small.txt", []byte("hello\n"))
	a.Add("big.txt", bytes.Repeat([]byte("x"), 5000))
	a.Add("mid.txt", bytes.Repeat([]byte("y"), 900))
	a.Add("rest.txt", bytes.Repeat([]byte("z"), 900)) // crosses the total: cut at it
	a.Add("late.txt", []byte("never"))
	a.Note("status: agent not running")
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	files := untar(t, buf.Bytes())
	if files["small.txt"] != "hello\n" {
		t.Errorf("small.txt = %q", files["small.txt"])
	}
	if big := files["big.txt"]; !strings.HasPrefix(big, strings.Repeat("x", 1000)+"\n[ambientd bundle: truncated: 1000 of 5000 bytes kept (--max-file-bytes=1000)]") || strings.Count(big, "xx") != 500 {
		t.Errorf("big.txt not cut at 1000 bytes with a marker: %d bytes, tail %q", len(big), big[max(0, len(big)-80):])
	}
	if rest := files["rest.txt"]; strings.Count(rest, "z") != 2500-6-1000-900 || !strings.Contains(rest, "(--max-total-bytes=2500)") {
		t.Errorf("rest.txt not cut at the total cap: %q", rest)
	}
	if _, ok := files["late.txt"]; ok {
		t.Error("late.txt written past the total cap")
	}
	m := files[ManifestName]
	for _, want := range []string{
		"file      small.txt (6 bytes)",
		"truncated big.txt (1000 of 5000 bytes kept: --max-file-bytes=1000)",
		"truncated rest.txt (594 of 900 bytes kept: --max-total-bytes=2500)",
		"left out  late.txt (5 bytes): the bundle reached --max-total-bytes=2500",
		"note      status: agent not running",
		"2500 bytes of files",
	} {
		if !strings.Contains(m, want) {
			t.Errorf("manifest lacks %q:\n%s", want, m)
		}
	}
	total := 0
	for name, data := range files {
		if name != ManifestName {
			content, _, _ := strings.Cut(data, "\n[ambientd bundle: truncated")
			total += len(content)
		}
	}
	if total > int(lim.MaxTotalBytes) {
		t.Errorf("files hold %d bytes of content, over the %d cap", total, lim.MaxTotalBytes)
	}
}

// TestArchiveCutNeverSplitsACredential: a token that crosses the per-file
// cut is redacted whole; no piece of it is kept before the cut.
func TestArchiveCutNeverSplitsACredential(t *testing.T) {
	jwt := "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJlLWJ5dGVz"
	data := strings.Repeat("a", 990) + " " + jwt + " " + strings.Repeat("b", 500)
	var buf bytes.Buffer
	a := NewArchive(&buf, "b", Limits{MaxFileBytes: 1000, MaxTotalBytes: 1 << 20}, time.Unix(0, 0))
	a.Add("f.txt", []byte(data))
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	f := untar(t, buf.Bytes())["f.txt"]
	if strings.Contains(f, "eyJ") || !strings.Contains(f, "[REDACTED") {
		t.Errorf("the cut kept part of the token: %q", f[980:])
	}
}
