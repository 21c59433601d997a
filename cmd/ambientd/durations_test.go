package main

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/ambientd/ambientd/settings"
)

// TestEveryDurationHasAFloorAndACeiling: every duration setting of
// `ambientd run` refuses a value below a safe floor and above a safe
// ceiling, whether it comes as a flag or as its environment variable (the
// chart's env: and ambientd.config reach the agent as variables). A new
// duration flag without bounds fails here.
func TestEveryDurationHasAFloorAndACeiling(t *testing.T) {
	var f runFlags
	fs := f.flagSet()
	var durations []string
	fs.VisitAll(func(fl *flag.Flag) {
		if g, ok := fl.Value.(flag.Getter); ok {
			if _, ok := g.Get().(time.Duration); ok {
				durations = append(durations, fl.Name)
			}
		}
	})
	if len(durations) < 15 {
		t.Fatalf("found %d duration flags (%v), want the run command's 15 or more", len(durations), durations)
	}
	base := []string{"--node-name=n", "--install-cni", "--taint-when-unready"}
	for _, name := range durations {
		for _, value := range []string{"1ns", "10000h"} {
			t.Run(name+"="+value, func(t *testing.T) {
				_, err := parseRunFlags(append(base, "--"+name+"="+value), func(string) string { return "" })
				if err == nil || !strings.Contains(err.Error(), "--"+name) {
					t.Errorf("--%s=%s: err = %v, want a refusal naming the flag", name, value, err)
				}
				env := settings.Var(name)
				_, err = parseRunFlags(base, func(k string) string {
					if k == env {
						return value
					}
					return ""
				})
				if err == nil || !strings.Contains(err.Error(), "--"+name) && !strings.Contains(err.Error(), env) {
					t.Errorf("%s=%s: err = %v, want a refusal naming the setting", env, value, err)
				}
			})
		}
	}
}
