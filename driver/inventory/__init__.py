"""The node's devices as discovery found them and health marked them, kept fresh per source."""
