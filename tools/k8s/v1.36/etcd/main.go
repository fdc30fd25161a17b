// Command etcd is etcd's own server, at the version k8s.io/kubernetes is built and tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
