package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"
	"k8s.io/kubernetes/pkg/kubelet/volumemanager"
	"k8s.io/kubernetes/pkg/volume"
	"k8s.io/kubernetes/pkg/volume/emptydir"
	volumetest "k8s.io/kubernetes/pkg/volume/testing"
	"k8s.io/kubernetes/pkg/volume/util/hostutil"
	"k8s.io/kubernetes/pkg/volume/util/volumepathhandler"
	"k8s.io/mount-utils"
)

// host is the kubelet's test volume host with the node's real mounter: the emptyDir plugin
// mounts its tmpfs exactly as on a node (mount-utils runs mount(8)).
type host struct {
	volume.VolumeHost
	mounter mount.Interface
}

func (h *host) GetMounter() mount.Interface { return h.mounter }

// pods is the kubelet's pod manager as the volume manager sees it.
type pods struct {
	sync.RWMutex
	byUID map[k8stypes.UID]*v1.Pod
	gone  map[k8stypes.UID]bool
}

func (p *pods) GetPodByUID(uid k8stypes.UID) (*v1.Pod, bool) {
	p.RLock()
	defer p.RUnlock()
	pod, ok := p.byUID[uid]
	return pod, ok
}

func (p *pods) GetPods() []*v1.Pod {
	p.RLock()
	defer p.RUnlock()
	out := make([]*v1.Pod, 0, len(p.byUID))
	for _, pod := range p.byUID {
		out = append(out, pod)
	}
	return out
}

func (p *pods) ShouldPodContainersBeTerminating(uid k8stypes.UID) bool {
	p.RLock()
	defer p.RUnlock()
	return p.gone[uid]
}

func (p *pods) ShouldPodRuntimeBeRemoved(uid k8stypes.UID) bool {
	return p.ShouldPodContainersBeTerminating(uid)
}

type ready struct{}

func (ready) AddSource(string) {}
func (ready) AllReady() bool   { return true }

func benchPod(i, volumes int) *v1.Pod {
	limit := resource.MustParse("1Mi")
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name:      fmt.Sprintf("bench-%d", i),
			Namespace: "bench",
			UID:       k8stypes.UID(fmt.Sprintf("00000000-0000-4000-8000-%012d", i)),
		},
		Spec: v1.PodSpec{NodeName: "bench-node"},
	}
	c := v1.Container{Name: "c", Image: "busybox"}
	for v := 0; v < volumes; v++ {
		name := fmt.Sprintf("v%d", v)
		pod.Spec.Volumes = append(pod.Spec.Volumes, v1.Volume{
			Name:         name,
			VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{Medium: v1.StorageMediumMemory, SizeLimit: &limit}},
		})
		c.VolumeMounts = append(c.VolumeMounts, v1.VolumeMount{Name: name, MountPath: "/" + name})
	}
	pod.Spec.Containers = []v1.Container{c}
	return pod
}

func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1)*p + 0.5)
	return sorted[i]
}

// volumeManager runs the kubelet's VolumeManager (pkg/kubelet/volumemanager) on N pods of M
// Memory emptyDir volumes added at once, as kubevol's benchmark does, and prints the pods'
// ready latencies and the teardown time.
func volumeManager(args []string) {
	fs := flag.NewFlagSet("volume-manager", flag.ExitOnError)
	root := fs.String("root", "", "the kubelet's root directory (pods are set up under <root>/pods)")
	n := fs.Int("pods", 1000, "pods")
	m := fs.Int("volumes", 4, "Memory emptyDir volumes per pod")
	_ = fs.Parse(args)
	if *root == "" {
		fail("volume-manager: --root is needed")
	}
	client := fake.NewSimpleClientset()
	fakeHost := volumetest.NewFakeKubeletVolumeHost(&testing.T{}, *root, client, nil)
	h := &host{VolumeHost: fakeHost, mounter: mount.New("")}
	plugins := &volume.VolumePluginMgr{}
	if err := plugins.InitPlugins(emptydir.ProbeVolumePlugins(), nil, h); err != nil {
		fail("init plugins: %v", err)
	}
	podManager := &pods{byUID: map[k8stypes.UID]*v1.Pod{}, gone: map[k8stypes.UID]bool{}}
	vm := volumemanager.NewVolumeManager(true, "bench-node", podManager, podManager, client, plugins,
		h.mounter, hostutil.NewHostUtil(), *root+"/pods", record.NewFakeRecorder(1<<20),
		volumepathhandler.NewBlockVolumePathHandler(), nil, 0)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go vm.Run(ctx, ready{})

	all := make([]*v1.Pod, *n)
	for i := range all {
		all[i] = benchPod(i, *m)
	}
	start := time.Now()
	podManager.Lock()
	for _, p := range all {
		podManager.byUID[p.UID] = p
	}
	podManager.Unlock()
	latencies := make([]float64, len(all))
	var wg sync.WaitGroup
	errs := make(chan error, len(all))
	for i, p := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wait, stop := context.WithTimeout(ctx, 10*time.Minute)
			defer stop()
			if err := vm.WaitForAttachAndMount(wait, p); err != nil {
				errs <- err
				return
			}
			latencies[i] = time.Since(start).Seconds()
		}()
	}
	wg.Wait()
	mounted := time.Since(start)
	close(errs)
	for err := range errs {
		fail("WaitForAttachAndMount: %v", err)
	}
	sort.Float64s(latencies)

	start = time.Now()
	podManager.Lock()
	for _, p := range all {
		podManager.gone[p.UID] = true
		delete(podManager.byUID, p.UID)
	}
	podManager.Unlock()
	for _, p := range all {
		wait, stop := context.WithTimeout(ctx, 10*time.Minute)
		if err := vm.WaitForUnmount(wait, p); err != nil {
			fail("WaitForUnmount: %v", err)
		}
		stop()
	}
	unmounted := time.Since(start)
	fmt.Printf("p50 %.6f p99 %.6f max %.6f mounted %.6f unmounted %.6f\n",
		percentile(latencies, 0.5), percentile(latencies, 0.99), latencies[len(latencies)-1],
		mounted.Seconds(), unmounted.Seconds())
	os.Stdout.Sync()
}
