//go:build tools

// Package kube pins the dependencies of the upstream main packages that
// test/infra/build builds from this module (kube-apiserver, kubelet,
// kube-controller-manager and kube-scheduler of Kubernetes 1.35) in its
// go.mod/go.sum. It is never compiled.
package kube

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
