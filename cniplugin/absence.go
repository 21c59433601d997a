package cniplugin

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambientd/ambientd/cniapi"
)

// maxAbsenceSize bounds what the plugin reads of an absence record (the
// waiting pods' names at most, and the recent attempts).
const maxAbsenceSize = 256 << 10

// addAbsence adds one ADD's outcome to the record r (pure).
func addAbsence(r cniapi.AbsenceRecord, at time.Time, pod *cniapi.Pod, d absentDecision, v leaseVerdict) cniapi.AbsenceRecord {
	if r.Version != cniapi.AbsenceVersion || r.First.IsZero() {
		r = cniapi.AbsenceRecord{Version: cniapi.AbsenceVersion, First: at}
	}
	r.Last = at
	r.AwayLong = r.AwayLong || v.awayLong
	if v.usable && v.lease.Renewed.After(r.AgentLastSeen) {
		r.AgentLastSeen = v.lease.Renewed
	}
	switch {
	case d.pass && d.uninstall:
		r.Uninstalled++
	case d.pass:
		r.Passed++
	default:
		r.Refused++
		if key := pod.Namespace + "/" + pod.Name; len(r.Waiting) < cniapi.MaxAbsenceWaiting && !slices.Contains(r.Waiting, key) {
			r.Waiting = append(r.Waiting, key)
		}
	}
	r.Recent = append(r.Recent, cniapi.AbsenceAttempt{At: at, Namespace: pod.Namespace, Name: pod.Name, Pass: d.pass, Reason: d.reason})
	if n := len(r.Recent); n > cniapi.MaxAbsenceRecent {
		r.Recent = r.Recent[n-cniapi.MaxAbsenceRecent:]
	}
	return r
}

// recordAbsence adds the ADD to the absence record in dir (the agent's run
// dir), under a lock on the file with a deadline. It never fails the ADD:
// the record is for people, the decision is made.
func recordAbsence(dir string, pod *cniapi.Pod, d absentDecision, v leaseVerdict, log *slog.Logger) {
	if err := updateAbsence(dir, pod, d, v); err != nil {
		log.Warn("cannot update the absence record for the next agent", "path", filepath.Join(dir, cniapi.AbsenceFile), "error", err)
	}
}

func updateAbsence(dir string, pod *cniapi.Pod, d absentDecision, v leaseVerdict) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, cniapi.AbsenceFile), os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	for wait := time.Millisecond; ; wait = min(2*wait, 20*time.Millisecond) {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			return err
		}
		select {
		case <-ctx.Done():
			return errors.New("the record is locked by another process")
		case <-time.After(wait):
		}
	}
	data, err := io.ReadAll(io.LimitReader(f, maxAbsenceSize))
	if err != nil {
		return err
	}
	var r cniapi.AbsenceRecord
	_ = json.Unmarshal(data, &r) // a record it cannot read starts anew
	out, err := json.Marshal(addAbsence(r, time.Now().UTC(), pod, d, v))
	if err != nil {
		return err
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err = f.WriteAt(out, 0)
	return err
}
