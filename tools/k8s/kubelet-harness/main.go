// kubelet-harness runs pieces of the kubelet's own volume code, built from the pinned
// k8s.io/kubernetes module, so that `kubevol bench` measures kubevol side by side with them on
// the same machine and the same input.
//
//	kubelet-harness fsgroup DIR GID Always|OnRootMismatch [ro]
//
// runs the kubelet's SetVolumeOwnership (pkg/volume.NewVolumeOwnership(...).ChangePermissions)
// on DIR and prints one line: "seconds <s>".
//
//	kubelet-harness du DIR
//
// runs the kubelet's metrics of an emptyDir volume (pkg/volume.NewMetricsDu(DIR).GetMetrics:
// fs.DiskUsage, then statfs) and prints one line: "seconds <s> bytes <n> inodes <n>".
//
//	kubelet-harness volume-manager --root DIR --pods N --volumes M
//
// runs the kubelet's VolumeManager (pkg/kubelet/volumemanager, with the emptyDir plugin and the
// node's real mounter) on N pods of M Memory emptyDir volumes added at once and prints one line:
// "p50 <s> p99 <s> max <s> mounted <s> unmounted <s>".
package main

import (
	"fmt"
	"os"
	"strconv"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/volume"
	"k8s.io/kubernetes/pkg/volume/util/types"
)

// mounter is the least volume.Mounter the ownership change asks of a plugin: its path and
// whether it is read-only.
type mounter struct {
	volume.MetricsNil
	dir      string
	readOnly bool
}

func (m *mounter) GetPath() string                          { return m.dir }
func (m *mounter) SetUp(volume.MounterArgs) error           { return nil }
func (m *mounter) SetUpAt(string, volume.MounterArgs) error { return nil }
func (m *mounter) GetAttributes() volume.Attributes         { return volume.Attributes{ReadOnly: m.readOnly} }

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "kubelet-harness: "+format+"\n", args...)
	os.Exit(2)
}

func fsGroup(args []string) {
	if len(args) < 3 {
		fail("usage: fsgroup DIR GID Always|OnRootMismatch [ro]")
	}
	gid, err := strconv.ParseInt(args[1], 10, 64)
	if err != nil {
		fail("GID %q: %v", args[1], err)
	}
	policy := v1.PodFSGroupChangePolicy(args[2])
	if policy != v1.FSGroupChangeAlways && policy != v1.FSGroupChangeOnRootMismatch {
		fail("policy %q: Always or OnRootMismatch", args[2])
	}
	m := &mounter{dir: args[0], readOnly: len(args) > 3 && args[3] == "ro"}
	var walkErr error
	done := func(p types.CompleteFuncParam) {
		if p.Err != nil {
			walkErr = *p.Err
		}
	}
	start := time.Now()
	changer := volume.NewVolumeOwnership(m, m.dir, &gid, &policy, done)
	if err := changer.ChangePermissions(); err != nil {
		fail("ChangePermissions: %v", err)
	}
	elapsed := time.Since(start)
	if walkErr != nil {
		fail("ChangePermissions: %v", walkErr)
	}
	fmt.Printf("seconds %.6f\n", elapsed.Seconds())
}

func du(args []string) {
	if len(args) != 1 {
		fail("usage: du DIR")
	}
	start := time.Now()
	m, err := volume.NewMetricsDu(args[0]).GetMetrics()
	elapsed := time.Since(start)
	if err != nil {
		fail("GetMetrics: %v", err)
	}
	fmt.Printf("seconds %.6f bytes %d inodes %d\n", elapsed.Seconds(), m.Used.Value(), m.InodesUsed.Value())
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: kubelet-harness fsgroup ...")
	}
	switch os.Args[1] {
	case "fsgroup":
		fsGroup(os.Args[2:])
	case "du":
		du(os.Args[2:])
	case "volume-manager":
		volumeManager(os.Args[2:])
	default:
		fail("unknown command %q", os.Args[1])
	}
}
