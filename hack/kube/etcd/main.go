// Command etcd is upstream etcd's server main, built from the version that
// k8s.io/kubernetes requires so the e2e control plane matches a real cluster.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
