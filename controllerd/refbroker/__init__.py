"""The reference broker: the Pulsar admin API over etcd and Kafka, reporter and client."""
