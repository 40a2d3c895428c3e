package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	metav1ac "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceac "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

const cdiClass = "claim"

// driver implements kubeletplugin.DRAPlugin. The helper already serialises the calls (its
// default), reads each claim and checks it is allocated; the checkpoint still has its own lock
// so the driver stays correct with serialisation off.
type driver struct {
	work    bool // tandem-work mode
	name    string
	pool    string
	client  kubernetes.Interface
	cdi     *cdiapi.Cache
	vendor  string
	devices map[string]resourceapi.Device
	ckpt    *checkpoint
}

var _ kubeletplugin.DRAPlugin = (*driver)(nil)

func newDriver(mode, name, node, dataDir, cdiRoot string, fsync bool, client kubernetes.Interface, devices []resourceapi.Device) (*driver, error) {
	// No auto-refresh: the example driver's registry also watches the directory and re-reads
	// every spec after each write, which a driver that only writes specs does not need.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiRoot), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, err
	}
	d := &driver{
		work:    mode == "tandem-work",
		name:    name,
		pool:    node,
		client:  client,
		cdi:     cache,
		vendor:  "k8s." + name,
		devices: make(map[string]resourceapi.Device, len(devices)),
	}
	for _, dev := range devices {
		d.devices[dev.Name] = dev
	}
	if d.work {
		if d.ckpt, err = openCheckpoint(dataDir, fsync); err != nil {
			return nil, err
		}
	}
	return d, nil
}

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, claim := range claims {
		devices, err := d.prepare(ctx, claim)
		out[claim.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return out, nil
}

func (d *driver) prepare(ctx context.Context, claim *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	uid := string(claim.UID)
	var results []resourceapi.DeviceRequestAllocationResult
	for _, r := range claim.Status.Allocation.Devices.Results {
		if r.Driver == d.name && r.Pool == d.pool {
			results = append(results, r)
		}
	}
	if d.work {
		rec, ok := d.ckpt.get(uid)
		if ok && rec.State == stateCompleted {
			return d.answer(rec.Devices), nil
		}
		rec = claimRecord{Namespace: claim.Namespace, Name: claim.Name, State: stateStarted}
		for _, r := range results {
			rec.Devices = append(rec.Devices, deviceRecord{RequestNames: []string{r.Request}, Pool: r.Pool, Device: r.Device, ShareID: shareID(r)})
		}
		if err := d.ckpt.put(uid, rec); err != nil {
			return nil, err
		}
	}

	spec := &cdispec.Spec{Kind: d.vendor + "/" + cdiClass}
	var records []deviceRecord
	for _, r := range results {
		dev, ok := d.devices[r.Device]
		if !ok {
			return nil, fmt.Errorf("device %q is not on this node", r.Device)
		}
		cdiName := uid + "-" + r.Device
		spec.Devices = append(spec.Devices, cdispec.Device{Name: cdiName, ContainerEdits: gpuEdits(dev)})
		records = append(records, deviceRecord{
			RequestNames: []string{r.Request}, Pool: r.Pool, Device: r.Device,
			CDIDeviceIDs: []string{spec.Kind + "=" + cdiName}, ShareID: shareID(r),
		})
	}
	version, err := cdiapi.MinimumRequiredVersion(spec)
	if err != nil {
		return nil, err
	}
	spec.Version = version
	if err := d.cdi.WriteSpec(spec, d.specName(uid)); err != nil {
		return nil, err
	}
	if !d.work {
		return d.answer(records), nil
	}

	if err := d.applyStatus(ctx, claim.Namespace, claim.Name, claim.UID, records); err != nil {
		return nil, err
	}
	rec := claimRecord{Namespace: claim.Namespace, Name: claim.Name, State: stateCompleted, Devices: records}
	if err := d.ckpt.put(uid, rec); err != nil {
		return nil, err
	}
	// The helper writes the device metadata (two fsynced files) after this returns.
	return d.answer(records), nil
}

// answer is the helper's result for the devices of a claim; with metadata enabled, each carries
// its published attributes, which the helper writes into the metadata file.
func (d *driver) answer(records []deviceRecord) []kubeletplugin.Device {
	out := make([]kubeletplugin.Device, 0, len(records))
	for _, r := range records {
		dev := kubeletplugin.Device{Requests: r.RequestNames, PoolName: r.Pool, DeviceName: r.Device, CDIDeviceIDs: r.CDIDeviceIDs}
		if d.work {
			attrs := make(map[string]resourceapi.DeviceAttribute, len(d.devices[r.Device].Attributes))
			for k, v := range d.devices[r.Device].Attributes {
				attrs[string(k)] = v
			}
			dev.Metadata = &kubeletplugin.DeviceMetadata{Attributes: attrs}
		}
		out = append(out, dev)
	}
	return out
}

// applyStatus server-side applies this driver's status.devices entries (none: withdraw them),
// with the claim's UID as a precondition, as Tandem does.
func (d *driver) applyStatus(ctx context.Context, namespace, name string, uid types.UID, records []deviceRecord) error {
	status := resourceac.ResourceClaimStatus()
	now := metav1.Now()
	for _, r := range records {
		entry := resourceac.AllocatedDeviceStatus().WithDriver(d.name).WithPool(r.Pool).WithDevice(r.Device)
		if r.ShareID != "" {
			entry.WithShareID(r.ShareID)
		}
		status.WithDevices(entry.
			WithConditions(metav1ac.Condition().
				WithType("Ready").WithStatus(metav1.ConditionTrue).WithReason("Prepared").
				WithMessage("prepared on node " + d.pool).WithLastTransitionTime(now)))
	}
	claim := resourceac.ResourceClaim(name, namespace).WithUID(uid).WithStatus(status)
	_, err := d.client.ResourceV1().ResourceClaims(namespace).ApplyStatus(ctx, claim, metav1.ApplyOptions{FieldManager: d.name, Force: true})
	return err
}

func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	out := make(map[types.UID]error, len(claims))
	for _, claim := range claims {
		out[claim.UID] = d.unprepare(ctx, claim)
	}
	return out, nil
}

func (d *driver) unprepare(ctx context.Context, claim kubeletplugin.NamespacedObject) error {
	uid := string(claim.UID)
	if err := d.cdi.RemoveSpec(d.specName(uid)); err != nil {
		return err
	}
	if !d.work {
		return nil
	}
	if _, ok := d.ckpt.get(uid); !ok {
		return nil
	}
	err := d.applyStatus(ctx, claim.Namespace, claim.Name, claim.UID, nil)
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return err
	}
	// The helper removes the device metadata after this returns.
	return d.ckpt.remove(uid)
}

// shareID is the allocation's share of a multi-allocatable device, "" for a device held whole.
func shareID(r resourceapi.DeviceRequestAllocationResult) string {
	if r.ShareID == nil {
		return ""
	}
	return string(*r.ShareID)
}

func (d *driver) specName(uid string) string {
	return cdiapi.GenerateTransientSpecName(d.vendor, cdiClass, uid) + ".json"
}

func (d *driver) HandleError(_ context.Context, err error, msg string) {
	fmt.Fprintf(os.Stderr, "refdriver: %s: %v\n", msg, err)
	if !errors.Is(err, kubeletplugin.ErrRecoverable) {
		os.Exit(1)
	}
}

func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

// gpuEdits are a device's container edits: a GPU's device node and the control nodes, and its UUID;
// a device without a minor number (a NIC of -devices-file) gets its name in the environment only.
func gpuEdits(dev resourceapi.Device) cdispec.ContainerEdits {
	minor, uuid := dev.Attributes["minor"].IntValue, dev.Attributes["uuid"].StringValue
	if minor == nil || uuid == nil {
		return cdispec.ContainerEdits{Env: []string{"REFDRIVER_DEVICE=" + dev.Name}}
	}
	return cdispec.ContainerEdits{
		Env: []string{"NVIDIA_VISIBLE_DEVICES=" + *uuid},
		DeviceNodes: []*cdispec.DeviceNode{
			{Path: fmt.Sprintf("/dev/nvidia%d", *minor)},
			{Path: "/dev/nvidiactl"},
			{Path: "/dev/nvidia-uvm"},
			{Path: "/dev/nvidia-uvm-tools"},
		},
	}
}
