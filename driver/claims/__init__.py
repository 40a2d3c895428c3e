"""The claim flow: from the kubelet's NodePrepareResources to the files, processes and status a
prepared claim leaves on the node, and back. Device kinds add their own steps beneath it
(`gpu/`: MPS, time slices, dynamic MIG; `nic/`: NIC modes, set-up in the pod, the return home).
It reads the inventory but never changes it, and it imports neither `slices` nor `health`.
"""
