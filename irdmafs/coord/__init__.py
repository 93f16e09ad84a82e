"""The coordination service: views and leases kept in etcd (see contract.py)."""
