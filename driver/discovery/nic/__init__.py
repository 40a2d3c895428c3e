"""RDMA NIC discovery through netlink and sysfs, and the watcher that reruns it."""
