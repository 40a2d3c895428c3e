"""GPU health: NVML events and probes become conditions that come and go."""
