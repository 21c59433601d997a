package main

import (
	"fmt"
	"os"
)

// rulesCmd prints the rule text. Placeholder until the iptables issue lands.
func rulesCmd(args []string) int {
	fmt.Fprintln(os.Stderr, "ambientd rules: not implemented yet")
	return 1
}
