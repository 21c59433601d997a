package main

import (
	"errors"
	"flag"
	"fmt"
	"sort"
)

// flagEnv maps a command's flag names to the environment variables that set
// them when the command line does not.
type flagEnv map[string]string

// parseFlags is how every subcommand reads its settings: it names each
// flag's variable in the flag's usage, parses args, then sets every flag of
// envs that the command line did not give from its variable, when that is
// set and not empty. A flag wins over its variable, a variable over the
// default; a variable whose value the flag refuses is an error naming both,
// and every such error is returned (joined) after every other variable
// was applied.
// envs name flags of fs only (a programming error panics). An error of the
// command line itself is a parseError (fs has printed it, with the usage)
// or flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string, getenv func(string) string, envs ...flagEnv) error {
	for _, env := range envs {
		for name, v := range env {
			fl := fs.Lookup(name)
			if fl == nil {
				panic(fmt.Sprintf("%s: environment variable %s names no flag --%s", fs.Name(), v, name))
			}
			fl.Usage += " (env " + v + ")"
		}
	}
	if err := fs.Parse(args); err != nil {
		return parseError{err}
	}
	given := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	// Every variable is applied, whatever another one's value: a value
	// that fails to parse must not keep the settings after it (in sorted
	// order) from taking effect — the install lease's among them, which
	// the plugin needs while this agent cannot start. All errors are
	// reported, in a fixed order.
	var errs []error
	for _, env := range envs {
		names := make([]string, 0, len(env))
		for name := range env {
			names = append(names, name)
		}
		sort.Strings(names) // the same variable is reported first every time
		for _, name := range names {
			if v := getenv(env[name]); v != "" && !given[name] {
				if err := fs.Set(name, v); err != nil {
					errs = append(errs, fmt.Errorf("%s (for --%s): %w", env[name], name, err))
				}
			}
		}
	}
	return errors.Join(errs...)
}

// parseError is an error of the command line, which the flag set printed.
type parseError struct{ err error }

func (e parseError) Error() string { return e.err.Error() }
func (e parseError) Unwrap() error { return e.err }

// isParseError reports whether err is an error of the command line that the
// flag set already printed (flag.ErrHelp included).
func isParseError(err error) bool {
	var pe parseError
	return errors.As(err, &pe)
}
