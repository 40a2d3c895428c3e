"""Tandem on N nodes of one real control plane, side by side with the Go reference driver (issue 24, part 2).

What runs (all on this machine, in a state directory of its own under /tmp, on ports of its own, so
that it never meets `hack/cluster.sh`'s cluster):

* the control plane of `hack/cluster.sh`, started by its launcher (`control_plane`): etcd,
  kube-apiserver, kube-scheduler and kube-controller-manager with the cluster's certificates,
  flags and DRA feature gates (hack/cluster/components.conf), and the launcher's `scale` profile
  beside them: its own ports, an audit log of the two drivers' requests (who sent what: the API
  server's `apiserver_request_total` has no user-agent label), higher client rate limits;
* N Node objects (`scale-node-000` ...), each a simulated HGX H100 (`sim.profile.h100_node`: 8 GPUs
  and 8 RoCE NICs, two of each behind each of 4 PCIe switches) rendered under its own directory;
* per node (`drivers`), Tandem (`python -m driver run`, a real process: its own data, registration
  and CDI directories and sockets, `--nic-link-source sysfs`) with a token of the `tandem-driver`
  service account bound to its Node, under the RBAC and the admission policy of `daemonset.yaml`;
* per node, the Go reference driver of `hack/go-reference/` (`k8s.io/dynamic-resource-allocation`
  v0.37.2's kubeletplugin helper, mode tandem-work: checkpoint, CDI spec, device metadata, claim
  status by server-side apply) as driver `a.ref.tandem.dev` on even nodes and `z.ref.tandem.dev` on
  odd ones (`objects.REF_NAMES` says why), publishing the very devices Tandem published for that
  node (`-devices-file`, attributes in the domain `ref.tandem.dev`), with a node-bound token of a
  service account of its own (`ref-driver`, the same rules);
* one kubelet stand-in process for all N nodes (`standin`, which says why not kubemark).

Measured, in one run (`run`, `measure`, `slices`): time from start until every node's slices are
published (all instances started at once; Tandem first, then Go, each alone); API requests per
second of each driver at idle and during churn (audit log), writes apart; pods created at a steady
rate, alternating between the two drivers: each with a GPU+NIC pair constrained to one PCIe switch
(`matchAttribute` on `pcieSwitch`), then each with one GPU: scheduling throughput (pods bound per
second), create→bound and create→Running p50/p99 per driver; the drivers' total CPU and memory
(RSS and PSS) idle and under churn; the CPU of every other process and the machine's load, to say
what limited throughput.

The pace is the bench's own: pods are created on a fixed schedule (`rate` pods per second) and each
Succeeds `hold` seconds after it ran; nothing else waits on a timer. Node count: `--nodes` or
TANDEM_SCALE_NODES (default 100; `--quick` 10). The modules import one another as `scale.*`, with
hack/ on sys.path as hack/bench.py puts it.
"""
