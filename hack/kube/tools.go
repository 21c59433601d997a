//go:build tools

// Package kube pins k8s.io/kubernetes/cmd/kube-apiserver's dependencies in
// this wrapper module's go.mod/go.sum; hack/build-kube.sh builds the upstream
// main package itself. It is never compiled.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
)
