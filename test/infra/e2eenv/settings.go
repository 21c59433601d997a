package e2eenv

import (
	"os"
	"strconv"
	"time"
)

// The defaults of a test program's flags from environment variables (each
// flag of bench and soak has one): the variable's value when it parses,
// else def.

// EnvInt is name's value as an int, or def.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// EnvString is name's value, or def when unset or empty.
func EnvString(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// EnvDuration is name's value as a time.Duration, or def.
func EnvDuration(name string, def time.Duration) time.Duration {
	if v, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// EnvBool is name's value as a bool, or false.
func EnvBool(name string) bool {
	v, _ := strconv.ParseBool(os.Getenv(name))
	return v
}

// EnvBoolOr is name's value as a bool, or def when unset or not a bool.
func EnvBoolOr(name string, def bool) bool {
	if v, err := strconv.ParseBool(os.Getenv(name)); err == nil {
		return v
	}
	return def
}
