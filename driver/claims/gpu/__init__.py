"""The claim flow's GPU steps: a shared GPU's MPS daemon and limits, a time-sliced GPU's interval,
and the MIG partitions Tandem carves on demand."""
