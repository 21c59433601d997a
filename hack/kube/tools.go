//go:build tools

// Package kube pins the dependencies of the upstream main packages that
// test/infra/build builds (kube-apiserver for the control plane; kubelet,
// kube-controller-manager, kube-scheduler and kubectl for the real node) in
// this wrapper module's go.mod/go.sum. It is never compiled.
package kube

import (
	_ "k8s.io/kubectl/pkg/cmd"
	_ "k8s.io/kubernetes/cmd/kube-apiserver/app"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
	_ "k8s.io/kubernetes/cmd/kubelet/app"
)
