package main

import (
	"fmt"
	"os"
)

// runCmd runs the node agent. Placeholder until the agent issue lands.
func runCmd(args []string) int {
	fmt.Fprintln(os.Stderr, "ambientd run: not implemented yet")
	return 1
}
