// Command refdriver is a reference DRA kubelet plugin built on the official
// k8s.io/dynamic-resource-allocation/kubeletplugin helper. hack/bench_reference.py runs it next to
// Tandem, against the same simulated API server and kubelet, so that Tandem's prepare path is
// measured against what Go costs for the same work (issue 13).
//
// Two modes:
//
//   - minimal: one CDI spec per claim, written with the CDI library as the example driver does;
//     nothing else.
//   - tandem-work: Tandem's per-claim work: a checkpoint record written before and after (durably
//     unless -checkpoint-fsync=false), the CDI spec, device metadata (the helper's own writer),
//     and the claim's status.devices by server-side apply; unprepare removes the files, clears the
//     status and drops the record.
//
// It is a yardstick, not a product: no health, no rediscovery, GPUs are made up from -gpus.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "refdriver:", err)
		os.Exit(1)
	}
}

func run() error {
	mode := flag.String("mode", "minimal", "minimal or tandem-work")
	driverName := flag.String("driver-name", "", "DRA driver name (required)")
	nodeName := flag.String("node-name", "", "this node; also the pool name (required)")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server (required)")
	registrarDir := flag.String("kubelet-registrar-dir", kubeletplugin.KubeletRegistryDir, "where the registration socket goes")
	pluginsDir := flag.String("kubelet-plugins-dir", kubeletplugin.KubeletPluginsDir, "the data dir is <it>/<driver name>")
	cdiRoot := flag.String("cdi-root", "/var/run/cdi", "CDI spec directory")
	gpus := flag.Int("gpus", 8, "how many GPUs to publish (gpu-0 ... gpu-N-1)")
	devicesFile := flag.String("devices-file", "", "publish these devices (a JSON list of resource.k8s.io/v1 Devices, e.g. another driver's slice of this node) instead of -gpus made-up GPUs")
	qps := flag.Float64("kube-api-qps", 1000, "client QPS: high, so client-side throttling never dominates")
	burst := flag.Int("kube-api-burst", 1000, "client burst")
	serialize := flag.Bool("serialize", true, "let the helper serialise prepare and unprepare calls (its default)")
	fsync := flag.Bool("checkpoint-fsync", true, "tandem-work: fsync the checkpoint (and its directory) on every write")
	flag.Parse()
	if *driverName == "" || *nodeName == "" || *kubeconfig == "" {
		return fmt.Errorf("-driver-name, -node-name and -kubeconfig are required")
	}
	if *mode != "minimal" && *mode != "tandem-work" {
		return fmt.Errorf("-mode %q: want minimal or tandem-work", *mode)
	}

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return err
	}
	cfg.ContentType = runtime.ContentTypeJSON
	cfg.AcceptContentTypes = runtime.ContentTypeJSON
	cfg.QPS, cfg.Burst = float32(*qps), *burst
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}

	dataDir := *pluginsDir + "/" + *driverName
	for _, dir := range []string{dataDir, *registrarDir, *cdiRoot} {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return err
		}
	}
	devices := makeGPUs(*gpus)
	if *devicesFile != "" {
		if devices, err = readDevices(*devicesFile); err != nil {
			return err
		}
	}
	drv, err := newDriver(*mode, *driverName, *nodeName, dataDir, *cdiRoot, *fsync, client, devices)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	opts := []kubeletplugin.Option{
		kubeletplugin.DriverName(*driverName),
		kubeletplugin.NodeName(*nodeName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.RegistrarDirectoryPath(*registrarDir),
		kubeletplugin.PluginDataDirectoryPath(dataDir),
		kubeletplugin.HealthService(false),
		kubeletplugin.Serialize(*serialize),
	}
	if *mode == "tandem-work" {
		opts = append(opts,
			// Both versions, newest first, as Tandem writes them: the same work on both sides.
			kubeletplugin.EnableDeviceMetadata(true, []schema.GroupVersion{metadatav1beta1.SchemeGroupVersion, metadatav1alpha1.SchemeGroupVersion}),
			kubeletplugin.CDIDirectory(*cdiRoot),
		)
	}
	helper, err := kubeletplugin.Start(ctx, drv, opts...)
	if err != nil {
		return err
	}
	defer helper.Stop()
	err = helper.PublishResources(ctx, resourceslice.DriverResources{
		Pools: map[string]resourceslice.Pool{*nodeName: {Slices: []resourceslice.Slice{{Devices: devices}}}},
	})
	if err != nil {
		return err
	}
	<-ctx.Done()
	return nil
}

// makeGPUs returns n GPUs shaped like the simulated node's: the bench allocates them by the
// "type" attribute, and the metadata files carry the attributes as Tandem's do.
func makeGPUs(n int) []resourceapi.Device {
	out := make([]resourceapi.Device, 0, n)
	for i := range n {
		out = append(out, resourceapi.Device{
			Name: fmt.Sprintf("gpu-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type":                            {StringValue: ptr.To("gpu")},
				"index":                           {IntValue: ptr.To(int64(i))},
				"minor":                           {IntValue: ptr.To(int64(i))},
				"uuid":                            {StringValue: ptr.To(fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", i, i))},
				"productName":                     {StringValue: ptr.To("NVIDIA H100 80GB HBM3")},
				"resource.kubernetes.io/pciBusID": {StringValue: ptr.To(fmt.Sprintf("0000:%02x:00.0", i+0x10))},
			},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": {Value: resource.MustParse("80Gi")},
			},
		})
	}
	return out
}

// readDevices reads the devices to publish from a JSON list of resource.k8s.io/v1 Devices:
// hack/scale/ hands each instance the devices Tandem published for its node, so that the
// two drivers offer the scheduler the same devices (attributes without a domain fall into this
// driver's own).
func readDevices(path string) ([]resourceapi.Device, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var devices []resourceapi.Device
	if err := json.Unmarshal(raw, &devices); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return devices, nil
}
