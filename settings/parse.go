// Package settings is how ambientd's commands read their settings: flags
// that each package registers beside its Config's fields, and for each flag
// an environment variable named by one rule (Var), which sets the flag when
// the command line does not. Parse reports every value that fails to parse
// — on the command line or in a variable — together, in a fixed order, not
// just the first.
package settings

import (
	"errors"
	"flag"
	"fmt"
	"strings"
	"time"
)

// IstioVars are the flags whose variable is not AMBIENTD_<FLAG>: the names
// Istio's istio-cni chart and the Kubernetes downward API set, so a
// DaemonSet written for istio-cni configures ambientd unchanged.
var IstioVars = map[string]string{
	"kubeconfig":          "KUBECONFIG",
	"node-name":           "NODE_NAME",
	"ztunnel-socket":      "ZTUNNEL_UDS_ADDRESS",
	"daemonset-namespace": "POD_NAMESPACE",
}

// Var is the environment variable of the agent's flag name:
// AMBIENTD_<NAME>, upper case with dashes as underscores
// (--ztunnel-grace: AMBIENTD_ZTUNNEL_GRACE), or its IstioVars name.
func Var(name string) string {
	if v, ok := IstioVars[name]; ok {
		return v
	}
	return "AMBIENTD_" + upper(name)
}

// CommandVar is the variable of a subcommand's own flag (one the agent
// does not have): AMBIENTD_<COMMAND>_<NAME> (`ambientd status --timeout`:
// AMBIENTD_STATUS_TIMEOUT).
func CommandVar(command, name string) string {
	return "AMBIENTD_" + upper(command) + "_" + upper(name)
}

func upper(s string) string { return strings.ToUpper(strings.ReplaceAll(s, "-", "_")) }

// Parse reads fs's flags from args, then sets every flag the command line
// did not give from its variable (varOf; "" or nil: none), when that is
// set and not empty: a flag wins over its variable, a variable over the
// default. Each variable is named in its flag's usage.
//
// A value that fails to parse does not stop the others from being read:
// every such value is reported, joined — the command line's in their order,
// then the variables' by flag name — and every other value takes effect.
// An error of the command line's syntax (an unknown flag, a missing value)
// is a *UsageError, which fs printed with the usage; -h is flag.ErrHelp.
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string, varOf func(name string) string) error {
	if varOf == nil {
		varOf = func(string) string { return "" }
	}
	fs.VisitAll(func(fl *flag.Flag) {
		if v := varOf(fl.Name); v != "" {
			fl.Usage += " (env " + v + ")"
		}
	})
	var errs []error
	if err := parseArgs(fs, args, &errs); err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	fs.VisitAll(func(fl *flag.Flag) { // sorted by name: a fixed order
		v := varOf(fl.Name)
		if v == "" || given[fl.Name] {
			return
		}
		if s := getenv(v); s != "" {
			if err := fs.Set(fl.Name, s); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q (for --%s): %s", v, s, fl.Name, why(fl.Value, err)))
			}
		}
	})
	return errors.Join(errs...)
}

// parseArgs is fs.Parse, but a value a flag refuses is added to errs and
// parsing goes on (flag.FlagSet stops at the first).
func parseArgs(fs *flag.FlagSet, args []string, errs *[]error) error {
	values := map[*flag.Flag]flag.Value{}
	fs.VisitAll(func(fl *flag.Flag) {
		values[fl] = fl.Value
		fl.Value = &collecting{Value: fl.Value, name: fl.Name, errs: errs}
	})
	restore := func() {
		for fl, v := range values {
			fl.Value = v
		}
	}
	usage := fs.Usage
	fs.Usage = func() { // -h or a syntax error: the usage shows the real values
		restore()
		if usage != nil {
			usage()
			return
		}
		fmt.Fprintf(fs.Output(), "Usage of %s:\n", fs.Name())
		fs.PrintDefaults()
	}
	err := fs.Parse(args)
	restore()
	fs.Usage = usage
	switch {
	case errors.Is(err, flag.ErrHelp):
		return err
	case err != nil:
		return &UsageError{err}
	}
	return nil
}

// collecting is a flag's value while the command line is parsed: a value
// the flag refuses is recorded, not returned.
type collecting struct {
	flag.Value
	name string
	errs *[]error
}

func (c *collecting) Set(s string) error {
	if err := c.Value.Set(s); err != nil {
		*c.errs = append(*c.errs, fmt.Errorf("--%s %q: %s", c.name, s, why(c.Value, err)))
	}
	return nil
}

// IsBoolFlag keeps `--flag` without a value working for a boolean flag.
func (c *collecting) IsBoolFlag() bool {
	b, ok := c.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// why is err in words: the standard flag values say only "parse error".
func why(v flag.Value, err error) string {
	if err.Error() != "parse error" {
		return err.Error()
	}
	if g, ok := v.(flag.Getter); ok {
		switch g.Get().(type) {
		case bool:
			return "want true or false"
		case time.Duration:
			return "want a duration such as 300ms, 10s or 1h"
		case int, int64, uint, uint64:
			return "want an integer"
		case float64:
			return "want a number"
		}
	}
	return err.Error()
}

// UsageError is an error of the command line's syntax, which the flag set
// printed with the usage.
type UsageError struct{ Err error }

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

// IsUsageError reports whether err is (or wraps) a *UsageError.
func IsUsageError(err error) bool {
	var ue *UsageError
	return errors.As(err, &ue)
}
