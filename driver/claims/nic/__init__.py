"""The claim flow's NIC steps: which mode a claim may hold a NIC in, the NicConfig applied inside
the pod, and an exclusive NIC's way back home to the host."""
