"""Simulated outside world: Kubernetes API server, node hardware (fake pynvml, sysfs), kubelet client."""
