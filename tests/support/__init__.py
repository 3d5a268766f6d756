"""Test fixtures that start real servers (etcd, Kafka) and fakes that speak real protocols."""
