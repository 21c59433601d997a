//go:build tools

// Package deps pins the libraries every room of ambientd builds on, so that
// parallel work on separate packages shares one go.mod. It is never compiled.
package deps

import (
	_ "github.com/containernetworking/cni/libcni"
	_ "github.com/containernetworking/cni/pkg/skel"
	_ "github.com/containernetworking/plugins/pkg/ns"
	_ "github.com/coreos/go-iptables/iptables"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/vishvananda/netlink"
	_ "github.com/vishvananda/netns"
	_ "golang.org/x/sys/unix"
	_ "golang.org/x/time/rate"
	_ "google.golang.org/grpc"
	_ "google.golang.org/grpc/health"
	_ "google.golang.org/protobuf/proto"
	_ "k8s.io/api/core/v1"
	_ "k8s.io/apimachinery/pkg/apis/meta/v1"
	_ "k8s.io/client-go/informers"
	_ "k8s.io/client-go/kubernetes"
	_ "k8s.io/client-go/tools/cache"
	_ "k8s.io/client-go/util/workqueue"
)
