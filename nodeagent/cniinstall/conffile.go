package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

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
	path string
	data []byte
	mode os.FileMode
	list bool // .conflist (else a single plugin)
	err  error
}

func (c confFile) valid() bool { return c.err == nil }

// readConf reads and validates path the way a runtime would load it.
func readConf(path string) confFile {
	c := confFile{name: filepath.Base(path), path: path, list: filepath.Ext(path) == ".conflist"}
	fi, err := os.Stat(path)
	if err != nil {
		c.err = err
		return c
	}
	c.mode = fi.Mode().Perm()
	if c.data, err = os.ReadFile(path); err != nil {
		c.err = err
		return c
	}
	c.err = validate(c.data, c.list)
	return c
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
		out = append(out, readConf(p))
	}
	return out, nil
}

// firstValid is the config the runtime uses: the first valid file, skipping
// the names in skip. ok is false when there is none.
func firstValid(confs []confFile, skip ...string) (confFile, bool) {
	for _, c := range confs {
		if c.valid() && !contains(skip, c.name) {
			return c, true
		}
	}
	return confFile{}, false
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

// writeAtomic writes data to path through a temp file in the same dir and a
// rename, so the runtime never reads a half-written file.
func writeAtomic(path string, data []byte, mode os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after the rename
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("chmod %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("renaming into %s: %w", path, err)
	}
	return nil
}
