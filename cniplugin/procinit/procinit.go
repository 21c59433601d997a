// Package procinit sets up the plugin process's Go runtime for what it is —
// a process exec'd once per pod sandbox that lives a few milliseconds — and
// records when its Go code began to run. Its initialisation runs before
// that of any package importing more than the standard library (the Go
// runtime initialises packages by dependencies, then by import path), so
// before gRPC's and protobuf's. It imports only the standard library's
// runtime packages, and must stay so: each import it gained would move it
// later.
//
// One P (GOMAXPROCS 1): the plugin does one thing after another, and a
// second P only makes the runtime start and wake more threads (each a
// clone, a stack, page faults, context switches) for goroutines that wait
// on the same socket. No collection below MemoryLimit: an ADD allocates a
// few hundred KiB in its whole life, and the process exits before a
// collection would pay off; past the limit the collector runs as usual, so
// a pathological input cannot grow the process without bound.
package procinit

import (
	"runtime"
	"runtime/debug"
	"time"
)

// MemoryLimit is the heap size past which the plugin's collector runs.
const MemoryLimit = 64 << 20

// At is when this package was initialised, in the process's first
// milliseconds. It is only read.
var At = time.Now()

func init() {
	runtime.GOMAXPROCS(1)
	debug.SetGCPercent(-1)
	debug.SetMemoryLimit(MemoryLimit)
}
