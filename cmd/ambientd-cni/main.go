// Command ambientd-cni: placeholder until its issue lands.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "ambientd-cni: not implemented yet")
	os.Exit(1)
}
