// Package procstart records when the plugin process's Go code began to run:
// its one variable is set by the package's initialisation, which the Go
// runtime runs before that of any package importing more than the standard
// library (initialisation goes by dependencies, then by import path), so it
// comes before gRPC's and protobuf's. It imports only time, and must stay
// so: each import it gained would move the mark later.
package procstart

import "time"

// At is when this package was initialised, in the process's first
// milliseconds. It is only read.
var At = time.Now()
