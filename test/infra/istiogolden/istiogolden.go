// Package istiogolden loads the golden cases test/istio-oracle writes from
// Istio's own code (make istio-oracle): for each case the pod as Istio's
// injector injected it, what Istio's CNI plugin made of it, and the rules
// Istio's builders produce (iptables-restore input per family, the nft
// transaction, the routes). The product's tests compare ambientd with them
// without building Istio: the files are committed.
package istiogolden

import (
	"bufio"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"

	"golang.org/x/tools/txtar"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// Case is one golden case.
type Case struct {
	Name, Doc string
	// Family is ipv4, ipv6 or dualstack; Addresses are the pod's interface
	// addresses at ADD (v4 first).
	Family    string
	Addresses []netip.Prefix
	// Input is the pod before injection, Injected the pod the plugin read
	// (nil when the injector refused it).
	Input, Injected *corev1.Pod
	// Injector is injector.txt.
	Injector string
	// Outcome is programmed, skipped or error; Error the plugin's error;
	// Log Istio's log line for its decision.
	Outcome, Error, Log string
	// Redirect is Istio's parsed Redirect (redirect.txt), key -> value.
	Redirect map[string]string
	// IPTables4 and IPTables6 are the iptables-restore --noflush input per
	// family ("" when absent); NFT the nft -f input; Routes routes.txt.
	IPTables4, IPTables6, NFT, Routes string
}

// Programmed reports whether Istio programmed rules for the pod.
func (c Case) Programmed() bool { return c.Outcome == "programmed" }

// IPs returns the pod's addresses.
func (c Case) IPs() []netip.Addr {
	out := make([]netip.Addr, len(c.Addresses))
	for i, p := range c.Addresses {
		out[i] = p.Addr()
	}
	return out
}

// Dir is the directory of the golden files.
func Dir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "istio-oracle", "testdata", "sidecar")
}

// Load reads every case, sorted by name.
func Load() ([]Case, error) {
	files, err := filepath.Glob(filepath.Join(Dir(), "*.txtar"))
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no golden cases in %s", Dir())
	}
	slices.Sort(files)
	var out []Case
	for _, f := range files {
		c, err := LoadFile(f)
		if err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

// LoadCase reads the case name.
func LoadCase(name string) (Case, error) {
	return LoadFile(filepath.Join(Dir(), name+".txtar"))
}

// LoadFile reads one case file.
func LoadFile(path string) (Case, error) {
	ar, err := txtar.ParseFile(path)
	if err != nil {
		return Case{}, err
	}
	c := Case{Redirect: map[string]string{}}
	for _, f := range ar.Files {
		data := string(f.Data)
		switch f.Name {
		case "case":
			kv := keyValues(data, ": ")
			c.Name, c.Doc, c.Family = kv["name"], kv["doc"], kv["family"]
			for _, a := range strings.Fields(kv["pod addresses"]) {
				p, err := netip.ParsePrefix(a)
				if err != nil {
					return c, fmt.Errorf("%s: pod address %q: %w", path, a, err)
				}
				c.Addresses = append(c.Addresses, p)
			}
		case "input.yaml":
			if c.Input, err = pod(data); err != nil {
				return c, fmt.Errorf("%s: input.yaml: %w", path, err)
			}
		case "injected.yaml":
			if c.Injected, err = pod(data); err != nil {
				return c, fmt.Errorf("%s: injected.yaml: %w", path, err)
			}
		case "injector.txt":
			c.Injector = data
		case "plugin.txt":
			kv := keyValues(data, ": ")
			c.Outcome, c.Error, c.Log = kv["outcome"], kv["error"], kv["log"]
		case "redirect.txt":
			c.Redirect = keyValues(data, "=")
		case "iptables.v4":
			c.IPTables4 = data
		case "iptables.v6":
			c.IPTables6 = data
		case "nft.txt":
			c.NFT = data
		case "routes.txt":
			c.Routes = data
		}
	}
	if c.Name == "" {
		return c, fmt.Errorf("%s: no case section", path)
	}
	return c, nil
}

func keyValues(s, sep string) map[string]string {
	out := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), sep); ok {
			out[k] = v
		}
	}
	return out
}

func pod(s string) (*corev1.Pod, error) {
	var p corev1.Pod
	if err := yaml.UnmarshalStrict([]byte(s), &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// WriteIPTables writes one family's restore input to a temp file (for the
// root tests that load it with iptables-restore).
func WriteTemp(dir, name, content string) (string, error) {
	p := filepath.Join(dir, name)
	return p, os.WriteFile(p, []byte(content), 0o600)
}
