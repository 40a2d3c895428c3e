"""NIC health: link and RDMA port state become conditions that come and go."""
