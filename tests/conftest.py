"""Fixtures every test module may use: real etcd and real Kafka, started on demand."""

from tests.support.etcd import (  # noqa: F401 - fixtures, registered by import
    etcd_prefix_fixture,
    etcd_server_fixture,
    store_fixture,
)
from tests.support.kafka import kafka_broker  # noqa: F401 - fixture
