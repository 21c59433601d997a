package cniinstall

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// Edits of files other components also write (the primary CNI's config)
// are compare-and-swap, so that a write of theirs is never replaced by our
// edit of their older text:
//
//  1. read the file (text, owner, mode, xattrs, identity);
//  2. write the edited text to a temp file beside it, with the same owner,
//     group, mode and xattrs;
//  3. just before swapping it in, read the file again: changed → start over
//     (the caller reads the conf dir again);
//  4. swap with renameat2(RENAME_EXCHANGE): atomically, our file takes the
//     name and theirs lands on the temp name — so we see exactly what we
//     replaced. When it is not what we read in 3 (another writer got in
//     between), that text is carried forward: edited and swapped in
//     again, until what we replace is what we based our edit on.
//
// The other writer's text therefore always survives, with our entry put
// in: at worst our edit of an older text is visible for the microseconds
// between two swaps. A filesystem without RENAME_EXCHANGE (EINVAL: NFS,
// some FUSE) gets step 3 and a plain rename: the window shrinks to the time
// between the re-read and the rename.

// errConflict means a file changed while we were changing it; the caller
// reads the conf dir again and redoes its pass.
var errConflict = errors.New("changed by another writer meanwhile")

// maxSwaps bounds one edit's rounds against a writer that rewrites the file
// in a tight loop; after that the pass fails with errConflict and is
// retried after the settle delay.
const maxSwaps = 20

// settleTries × settlePause is how long a file we took from a writer in the
// middle of its write (truncated, half written) is given to become whole.
const (
	settleTries = 25
	settlePause = 20 * time.Millisecond
)

// editFile rewrites the regular file path (read as first) to edit(text),
// compare-and-swap as described above, keeping owner, group, mode and
// xattrs. edit returning its input unchanged means nothing to do. wrote says
// whether the file was replaced.
func editFile(path string, first snapshot, edit func([]byte) ([]byte, error)) (wrote bool, err error) {
	return fileEditor{}.edit(path, first, edit)
}

// fileEditor runs editFile; beforeSwap, for tests, runs between the re-check
// and the swap (where another writer can still get in).
type fileEditor struct{ beforeSwap func(path string) }

func (e fileEditor) edit(path string, first snapshot, edit func([]byte) ([]byte, error)) (wrote bool, err error) {
	cur := first // what we expect at path right now
	src := first // the newest text of theirs, which our write must be based on
	for round := 0; round < maxSwaps; round++ {
		want, err := edit(src.data)
		if err != nil {
			if round == 0 {
				return false, err
			}
			// Their newest text cannot be edited (not a valid list): put it
			// back as they wrote it.
			want = src.data
		}
		if bytes.Equal(want, cur.data) && cur.attrs.keeps(src.attrs) {
			return wrote, nil
		}
		tmp, tmpAttrs, err := writeTemp(path, want, src.attrs)
		if err != nil {
			return wrote, err
		}
		// Nothing written yet: when the file changed since we read it, the
		// caller starts over from the conf dir (the file may be half
		// written, or no longer the one to edit).
		if now, err := readSnapshot(path); err != nil || !now.same(cur) {
			os.Remove(tmp)
			return wrote, fmt.Errorf("%s: %w (before our write: %v)", path, errConflict, err)
		}
		if e.beforeSwap != nil {
			e.beforeSwap(path)
		}
		swapped, err := exchange(tmp, path)
		if errors.Is(err, errNoExchange) {
			if err := os.Rename(tmp, path); err != nil {
				os.Remove(tmp)
				return wrote, fmt.Errorf("renaming into %s: %w", path, err)
			}
			return true, nil
		}
		if err != nil {
			os.Remove(tmp)
			return wrote, err
		}
		wrote = true
		if swapped.sameText(cur) {
			return true, nil
		}
		// Another writer replaced or rewrote the file between our re-read
		// and the swap: path holds our edit of older text, and theirs is in
		// swapped. Carry it forward. (The rename changed our file's ctime:
		// take its identity again.)
		now, err := readSnapshot(path)
		switch {
		case err == nil && now.attrs.ino == tmpAttrs.ino && bytes.Equal(now.data, want):
			cur, src = now, swapped
		case err == nil:
			cur, src = now, now // they wrote again since: that is their newest
		default:
			return wrote, fmt.Errorf("%s: %w (after our write: %v)", path, errConflict, err)
		}
	}
	return wrote, fmt.Errorf("%s: %w (%d rounds in a row)", path, errConflict, maxSwaps)
}

// errNoExchange: the filesystem cannot exchange two names atomically.
var errNoExchange = errors.New("RENAME_EXCHANGE not supported")

// exchange swaps tmp and path atomically, then reads and removes what is now
// at tmp (what path held). A file a writer had open and was still writing
// is given time to become whole (readWhole).
func exchange(tmp, path string) (snapshot, error) {
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.ENOTSUP) {
		return snapshot{}, errNoExchange
	}
	if err != nil {
		return snapshot{}, fmt.Errorf("swapping %s into place: %w", path, err)
	}
	f, err := os.OpenFile(tmp, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		// What we swapped out is not a regular file we can read (a
		// symlink took the name meanwhile): put it back, try again later.
		if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_EXCHANGE); err != nil {
			return snapshot{}, fmt.Errorf("%s: swapped out something unreadable and could not swap it back: %w", path, err)
		}
		os.Remove(tmp)
		return snapshot{}, fmt.Errorf("%s: %w (not a regular file)", path, errConflict)
	}
	defer f.Close()
	os.Remove(tmp) // the open fd keeps it readable
	return readWhole(f)
}

// readWhole reads f, and when its text is not valid JSON (a writer that
// truncated it is still writing) reads it again for a while until it is.
func readWhole(f *os.File) (snapshot, error) {
	s, err := readOpen(f)
	for try := 0; err == nil && !json.Valid(s.data) && try < settleTries; try++ {
		time.Sleep(settlePause)
		s, err = readOpen(f)
	}
	return s, err
}

// writeTemp writes data to a new temp file beside path with attrs' owner,
// group, mode and xattrs, synced, and returns its name and attributes.
func writeTemp(path string, data []byte, attrs fileAttrs) (string, fileAttrs, error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fileAttrs{}, fmt.Errorf("writing %s: %w", path, err)
	}
	tmp := f.Name()
	fail := func(err error) (string, fileAttrs, error) {
		f.Close()
		os.Remove(tmp)
		return "", fileAttrs{}, err
	}
	if _, err := f.Write(data); err != nil {
		return fail(fmt.Errorf("writing %s: %w", path, err))
	}
	if err := applyAttrs(f, attrs); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("sync %s: %w", path, err))
	}
	got, err := statAttrs(f)
	if err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		os.Remove(tmp)
		return "", fileAttrs{}, fmt.Errorf("writing %s: %w", path, err)
	}
	return tmp, got, nil
}

// writeAtomic writes a file only the installer writes (our binary, our
// owned config, a conflist we made): temp file + rename, so the runtime
// never reads half a file, with attrs' owner, group, mode and xattrs.
func writeAtomic(path string, data []byte, attrs fileAttrs) error {
	tmp, _, err := writeTemp(path, data, attrs)
	if err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("renaming into %s: %w", path, err)
	}
	return nil
}

// createFile creates path with data and attrs unless something already has
// that name (then errConflict): another component may create the same name
// at the same time, and its file wins.
func createFile(path string, data []byte, attrs fileAttrs) error {
	tmp, _, err := writeTemp(path, data, attrs)
	if err != nil {
		return err
	}
	defer os.Remove(tmp) // no-op once renamed
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.ENOTSUP) {
		err = os.Link(tmp, path) // also fails on an existing name
	}
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%s: %w (created by someone else)", path, errConflict)
	}
	if err != nil {
		return fmt.Errorf("creating %s: %w", path, err)
	}
	return nil
}

// removeFile removes path only if it still is the file read as expect: it
// is moved aside atomically and checked there; when another writer changed
// it meanwhile, it goes back (unless a newer file took the name: then that
// one is their last word) and the result is errConflict.
func removeFile(path string, expect snapshot) error {
	aside := filepath.Join(filepath.Dir(path), fmt.Sprintf(".%s.rm-%d", filepath.Base(path), time.Now().UnixNano()))
	if err := os.Rename(path, aside); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s: %w (removed by someone else)", path, errConflict)
		}
		return fmt.Errorf("removing %s: %w", path, err)
	}
	f, err := os.OpenFile(aside, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	var got snapshot
	if err == nil {
		got, err = readWhole(f)
		f.Close()
	}
	if err == nil && got.sameText(expect) {
		return os.Remove(aside)
	}
	// Not what we read: put it back without replacing a newer file.
	back := unix.Renameat2(unix.AT_FDCWD, aside, unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
	if errors.Is(back, unix.EINVAL) || errors.Is(back, unix.ENOSYS) || errors.Is(back, unix.ENOTSUP) {
		if back = os.Link(aside, path); back == nil {
			back = os.Remove(aside)
		}
	}
	if errors.Is(back, fs.ErrExist) {
		os.Remove(aside)
		back = nil
	}
	if back != nil {
		return fmt.Errorf("removing %s: it changed meanwhile and could not be put back from %s: %w", path, aside, back)
	}
	return fmt.Errorf("%s: %w", path, errConflict)
}
