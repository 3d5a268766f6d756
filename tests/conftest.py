"""Fixtures every test module may use: real etcd and real Kafka, started on demand.

Hypothesis runs without its per-example deadline: a first example that pays for
imports and warm-up on a busy 2-core CI runner is not a defect (speed is measured
under ``bench/``, never asserted in a test).
"""

from hypothesis import settings

from tests.support.etcd import (  # noqa: F401 - fixtures, registered by import
    etcd_prefix_fixture,
    etcd_server_fixture,
    store_fixture,
)
from tests.support.kafka import kafka_broker  # noqa: F401 - fixture

settings.register_profile("controllerd", deadline=None)
settings.load_profile("controllerd")
