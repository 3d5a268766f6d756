"""One module per outside system: etcd (store, election), the broker's admin REST,
the Kafka audit log and systemd's notify socket. Each raises its own documented
exceptions; no library type leaks out.
"""
