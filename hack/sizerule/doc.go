// Package sizerule holds the check that keeps the shipped code readable in
// pieces: no shipped Go file over MaxFileLines lines and no function over
// MaxFuncLines (size_test.go). Shipped means what the ambientd and
// ambientd-cni binaries are built from: not tests, not generated protobuf
// code, not test/ (the test product) or hack/ (the developer's tools).
package sizerule

// The limits: a file a reader can hold in one sitting, a function that fits
// on a screen or two.
const (
	MaxFileLines = 400
	MaxFuncLines = 100
)
