package settings

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// The flag values of settings whose text is more than one value: each
// parses its text into the Config field it points to, so a bad value is
// refused (and named) as the flag is set, and String gives the text back
// (the default in the usage, the settings in a support bundle).

// List is a comma-separated flag of names: items trimmed, empty ones
// dropped.
type List struct{ P *[]string }

func (l List) String() string {
	if l.P == nil {
		return ""
	}
	return strings.Join(*l.P, ",")
}

func (l List) Set(s string) error { *l.P = SplitList(s); return nil }
func (l List) Get() any           { return *l.P }

// SplitList reads a comma-separated list: its items trimmed, empty ones
// dropped.
func SplitList(s string) []string {
	var out []string
	for _, n := range strings.Split(s, ",") {
		if n = strings.TrimSpace(n); n != "" {
			out = append(out, n)
		}
	}
	return out
}

// UIDs is a comma-separated flag of one or more numeric uids.
type UIDs struct{ P *[]uint32 }

func (u UIDs) String() string {
	if u.P == nil {
		return ""
	}
	s := make([]string, len(*u.P))
	for i, v := range *u.P {
		s[i] = strconv.FormatUint(uint64(v), 10)
	}
	return strings.Join(s, ",")
}

func (u UIDs) Set(s string) error {
	var uids []uint32
	for _, p := range SplitList(s) {
		v, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return fmt.Errorf("%q is not a numeric uid", p)
		}
		uids = append(uids, uint32(v))
	}
	if len(uids) == 0 {
		return errors.New("want at least one uid (0: root)")
	}
	*u.P = uids
	return nil
}

func (u UIDs) Get() any { return *u.P }

// FileMode is a flag of octal permission bits, owner read-write at least
// (the agent owns what it sets them on), nothing beyond 0777.
type FileMode struct{ P *os.FileMode }

func (m FileMode) String() string {
	if m.P == nil {
		return ""
	}
	return fmt.Sprintf("%04o", uint32(*m.P))
}

func (m FileMode) Set(s string) error {
	v, err := strconv.ParseUint(s, 8, 32)
	if err != nil || v > 0o777 || v&0o600 != 0o600 {
		return errors.New("want octal permission bits including owner rw (e.g. 0600, 0660)")
	}
	*m.P = os.FileMode(v)
	return nil
}

func (m FileMode) Get() any { return *m.P }

// Positive is a duration flag that refuses 0 and less, for a Config field
// where 0 means "the default" to a caller in Go but would be a request for
// nothing on the command line. Its usage names its type: put "`duration`"
// in it.
type Positive struct{ P *time.Duration }

func (d Positive) String() string {
	if d.P == nil {
		return ""
	}
	return d.P.String()
}

func (d Positive) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return errors.New("want a duration such as 300ms, 10s or 1h")
	}
	if v <= 0 {
		return errors.New("must be positive")
	}
	*d.P = v
	return nil
}

func (d Positive) Get() any { return *d.P }
