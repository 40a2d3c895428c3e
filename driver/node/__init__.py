"""Doors to the node's kernel and NVIDIA driver that more than one flow goes through: NVML
(`nvml`, the only importer of pynvml), rtnetlink (`netlink`, whose messages `rtnl` decodes; its
half `netlink_pyroute2`, the only importer of pyroute2, writes links and opens sockets in named
namespaces, and is imported only then) and the NVIDIA driver root (`driver_root`: the files and
programs found there). Discovery, health and the claim flow all use them, so they sit below all
three rather than inside one."""
