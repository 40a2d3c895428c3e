"""GPU discovery through NVML: full GPUs, MIG devices, shared and dynamic-MIG GPUs."""
