// Command ztunnel-emulator: placeholder until its issue lands.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "ztunnel-emulator: not implemented yet")
	os.Exit(1)
}
