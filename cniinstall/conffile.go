package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/containernetworking/cni/libcni"
)

// confExtensions are the files container runtimes (containerd's go-cni,
// CRI-O's ocicni) read from the conf dir, in lexical order of name; the first
// valid one is the network they use. .conf and .json hold one plugin.
var confExtensions = []string{".conf", ".conflist", ".json"}

// convertedKey marks a conflist we made from a single-plugin .conf; its value
// is the .conf's name, restored (from the first plugin, which is the .conf's
// text verbatim) on uninstall. Runtimes ignore unknown top-level keys.
const convertedKey = "ambientdConvertedFrom"

// ownedKey marks the conflist the installer owns in owned mode; uninstall
// deletes a file of that name only when it carries the mark.
const ownedKey = "ambientdOwned"

// confFile is one config file of the conf dir, read and classified.
type confFile struct {
	name string // base name
	path string // its path in the conf dir (may be a symlink)
	// real is the regular file path names, symlinks resolved inside the
	// conf dir; edits go there, so a symlink stays a symlink.
	real string
	snap snapshot // real's text and attributes as read
	data []byte   // snap.data
	list bool     // .conflist (else a single plugin)
	err  error    // why a runtime would not load it
	// unknown: a symlink the agent cannot follow (absolute, or out of the
	// conf dir: inside the agent's container it would name another file
	// than on the host), so it cannot tell what the runtime reads there.
	unknown bool
}

func (c confFile) valid() bool { return c.err == nil }

// readConf reads and validates name in dir the way a runtime would load it.
func readConf(dir, name string) confFile {
	c := confFile{name: name, path: filepath.Join(dir, name), list: filepath.Ext(name) == ".conflist"}
	real, err := resolveInDir(dir, name)
	if err != nil {
		c.err, c.unknown = err, errors.Is(err, errOutside)
		return c
	}
	c.real = real
	if c.snap, err = readSnapshot(real); err != nil {
		c.err = err
		return c
	}
	c.data = c.snap.data
	c.err = validate(c.data, c.list)
	return c
}

// errOutside: a symlink in the conf dir that the agent cannot follow.
var errOutside = errors.New("a symlink the agent cannot follow")

// maxSymlinks bounds symlink resolution (as the kernel's ELOOP does).
const maxSymlinks = 40

// resolveInDir returns the path of the file name (in dir) refers to, every
// symlink on the way resolved without leaving dir. The conf dir is a host
// directory mounted into the agent's container: an absolute symlink, or
// one leading out of the dir, names another file in the container than on
// the host, so it is refused (errOutside) rather than followed.
func resolveInDir(dir, name string) (string, error) {
	var done []string                // resolved components below dir
	rest := strings.Split(name, "/") // components still to walk
	for links := 0; len(rest) > 0; {
		comp := rest[0]
		rest = rest[1:]
		switch comp {
		case "", ".":
			continue
		case "..":
			if len(done) == 0 {
				return "", fmt.Errorf("%s: %w (it leads out of %s)", filepath.Join(dir, name), errOutside, dir)
			}
			done = done[:len(done)-1]
			continue
		}
		p := filepath.Join(dir, filepath.Join(done...), comp)
		fi, err := os.Lstat(p)
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			done = append(done, comp)
			continue
		}
		if links++; links > maxSymlinks {
			return "", fmt.Errorf("%s: too many levels of symlinks", filepath.Join(dir, name))
		}
		target, err := os.Readlink(p)
		if err != nil {
			return "", err
		}
		if filepath.IsAbs(target) {
			return "", fmt.Errorf("%s: %w (it points to the absolute path %s, which inside the agent's container is not the host's file; make it relative within the conf dir)", filepath.Join(dir, name), errOutside, target)
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return filepath.Join(dir, filepath.Join(done...)), nil
}

func validate(data []byte, list bool) error {
	if !list {
		_, err := libcni.NetworkPluginConfFromBytes(data)
		return err
	}
	l, err := libcni.ConfListFromBytes(data)
	if err != nil {
		return err
	}
	if len(l.Plugins) == 0 {
		return errors.New("no plugins")
	}
	if _, err := parseList(data); err != nil {
		return err
	}
	return nil
}

// listConfs returns every config file of dir in the order runtimes consider
// them, valid or not.
func listConfs(dir string) ([]confFile, error) {
	paths, err := libcni.ConfFiles(dir, confExtensions)
	if err != nil {
		return nil, fmt.Errorf("listing CNI configs in %s: %w", dir, err)
	}
	// ConfFiles keeps os.ReadDir's order, which is sorted by name.
	out := make([]confFile, 0, len(paths))
	for _, p := range paths {
		out = append(out, readConf(dir, filepath.Base(p)))
	}
	return out, nil
}

// runtimeChoice is the config the runtime uses: the first valid file,
// skipping the names in skip. ErrNoConfig when there is none; an error when
// a file the agent cannot read as the runtime does (unknown) comes first.
func runtimeChoice(dir string, confs []confFile, skip ...string) (confFile, error) {
	for _, c := range confs {
		if contains(skip, c.name) {
			continue
		}
		if c.unknown {
			return c, fmt.Errorf("cannot tell which CNI config the runtime uses: %w", c.err)
		}
		if c.valid() {
			return c, nil
		}
	}
	return confFile{}, fmt.Errorf("%w (%s)", ErrNoConfig, dir)
}

// RuntimeConf is the CNI config a container runtime uses.
type RuntimeConf struct {
	Path  string   // in the conf dir (may be a symlink)
	Data  []byte   // its text
	Types []string // its plugins' types, in chain order
}

// RuntimeConfig says which CNI config the container runtime uses in dir:
// the first valid .conf, .conflist or .json file in lexical order, as
// containerd and CRI-O choose (runtimeChoice). It is the one answer to that
// question: the installer edits and checks that file, and without
// --install-cni the node condition's "plugin installed" reads it.
func RuntimeConfig(dir string) (RuntimeConf, error) {
	confs, err := listConfs(dir)
	if err != nil {
		return RuntimeConf{}, err
	}
	c, err := runtimeChoice(dir, confs)
	if err != nil {
		return RuntimeConf{}, err
	}
	rc := RuntimeConf{Path: c.path, Data: c.data}
	if !c.list {
		rc.Types = []string{pluginType(c.data)} // a single plugin: no chain
		return rc, nil
	}
	l, err := parseList(c.data)
	if err != nil {
		return RuntimeConf{}, fmt.Errorf("%s: %w", c.path, err)
	}
	for _, e := range l.elems {
		rc.Types = append(rc.Types, pluginType(c.data[e.start:e.end]))
	}
	return rc, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// hasKey reports whether the top-level object of data has key.
func hasKey(data []byte, key string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		return false
	}
	_, ok := m[key]
	return ok
}

// stringKey reads a top-level string field.
func stringKey(data []byte, key string) string {
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		return ""
	}
	var s string
	_ = json.Unmarshal(m[key], &s) // absent or not a string reads as ""
	return s
}

// listFromConf turns a single-plugin config into conflist text whose one
// plugin is the original text verbatim (libcni overrides name and
// cniVersion inside a list, so the extra fields are harmless), marked with
// markKey = markValue.
func listFromConf(conf []byte, markKey string, markValue any) ([]byte, error) {
	var head struct {
		CNIVersion string `json:"cniVersion,omitempty"`
		Name       string `json:"name"`
	}
	if err := json.Unmarshal(conf, &head); err != nil {
		return nil, err
	}
	mark, err := json.Marshal(markValue)
	if err != nil {
		return nil, err
	}
	name, _ := json.Marshal(head.Name)
	version, _ := json.Marshal(head.CNIVersion)
	var b bytes.Buffer
	b.WriteString("{\n  \"cniVersion\": ")
	b.Write(version)
	b.WriteString(",\n  \"name\": ")
	b.Write(name)
	fmt.Fprintf(&b, ",\n  %q: ", markKey)
	b.Write(mark)
	b.WriteString(",\n  \"plugins\": [")
	b.Write(conf)
	b.WriteString("]\n}\n")
	return b.Bytes(), nil
}

// confFromList recovers the original .conf text from a list listFromConf
// made, once our entries are removed: the one plugin's text as written,
// surrounding whitespace included. ok is false when the list has since
// gained other plugins (then it is no longer just the .conf).
func confFromList(list []byte) (conf []byte, ok bool) {
	l, err := parseList(list)
	if err != nil || len(l.elems) != 1 {
		return nil, false
	}
	return list[l.open+1 : l.close], true
}
