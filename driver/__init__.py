"""Tandem: a Kubernetes DRA driver for NVIDIA GPUs and RDMA (RoCE) NICs."""
