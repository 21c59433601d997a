package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
)

func envMap(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

// TestInjectCommand: `ambientd inject` reads stdin or -f and writes what
// admission/inject's golden files say; settings come from flags and the
// agent's variables; bad flags exit 2, bad input exits 1 and writes nothing.
func TestInjectCommand(t *testing.T) {
	in, err := os.ReadFile("../../admission/inject/testdata/mixed.in.yaml")
	if err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("../../admission/inject/testdata/mixed.golden.yaml")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var out, errb bytes.Buffer
	if code := runInject(ctx, []string{"-n", "tenant", "--ambient-namespaces", "tenant"}, envMap(), bytes.NewReader(in), &out, &errb); code != 0 || !bytes.Equal(out.Bytes(), want) {
		t.Errorf("stdin: exit %d, stderr %s, output equals golden: %v", code, errb.String(), bytes.Equal(out.Bytes(), want))
	}
	if !strings.Contains(errb.String(), "9 pod templates, gate added to 3") {
		t.Errorf("summary: %q", errb.String())
	}
	out.Reset()
	outFile := t.TempDir() + "/out.yaml"
	if code := runInject(ctx, []string{"-f", "../../admission/inject/testdata/mixed.in.yaml", "-o", outFile, "-n", "tenant", "--ambient-namespaces", "tenant"}, envMap(), nil, &out, &errb); code != 0 {
		t.Errorf("-f/-o: exit %d: %s", code, errb.String())
	}
	if got, _ := os.ReadFile(outFile); !bytes.Equal(got, want) || out.Len() != 0 {
		t.Errorf("-o file differs from golden, or stdout written (%d bytes)", out.Len())
	}

	out.Reset()
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: shop, labels: {istio.io/dataplane-mode: ambient}}\nspec: {containers: [{name: c, image: x}]}\n"
	if code := runInject(ctx, nil, envMap("AMBIENTD_POD_CONDITION_TYPE", "example.com/meshed"), strings.NewReader(pod), &out, &errb); code != 0 || !strings.Contains(out.String(), "conditionType: example.com/meshed") {
		t.Errorf("condition type from the environment: exit %d, output %s", code, out.String())
	}
	out.Reset()
	if code := runInject(ctx, []string{"--system-namespace", "shop"}, envMap(), strings.NewReader(strings.Replace(pod, "labels: {", "labels: {app: ztunnel, ", 1)), &out, &errb); code != 0 || strings.Contains(out.String(), "readinessGates") {
		t.Errorf("--system-namespace: ztunnel there must not be gated: exit %d, output %s", code, out.String())
	}

	for _, args := range [][]string{{"--system-namespace", "Bad_NS"}, {"--pod-condition-type", "not a condition"}, {"extra-arg"}, {"--exclude-namespaces", "a,B!"}} {
		out.Reset()
		errb.Reset()
		if code := runInject(ctx, args, envMap(), strings.NewReader(pod), &out, &errb); code != 2 || out.Len() != 0 {
			t.Errorf("%q: exit %d, stdout %q; want 2 and nothing", args, code, out.String())
		}
	}
	out.Reset()
	if code := runInject(ctx, nil, envMap(), strings.NewReader(pod+"---\n: [\n"), &out, &errb); code != 1 || out.Len() != 0 {
		t.Errorf("bad input: exit %d, stdout %q; want 1 and nothing written", code, out.String())
	}
}

// TestCheckCommandFlags: usage errors exit 2 before any cluster access.
func TestCheckCommandFlags(t *testing.T) {
	for _, args := range [][]string{{"-o", "yaml"}, {"-A", "-n", "x"}, {"-f", "m.yaml", "pod-a"}, {"--timeout", "0s"}, {"--system-namespace", "Bad_NS"},
		{"--cluster-breakers", "pod-a"}, {"--cluster-breakers", "-A"}, {"--cluster-breakers", "-f", "m.yaml"}} {
		var out, errb bytes.Buffer
		if code := runCheck(context.Background(), args, envMap(), nil, &out, &errb); code != 2 {
			t.Errorf("%q: exit %d (%s), want 2", args, code, errb.String())
		}
	}
}
