"""The one retry schedule of controllerd: capped exponential backoff with jitter.

Every adapter and the daemon take their waits from a :class:`Backoff` defined
here, so replicas never retry in lockstep and the schedule is tuned in one
place. Jitter is "equal jitter": the wait is uniform in ``[ceiling / 2,
ceiling]`` with ``ceiling = min(cap, first * 2**attempt)``. Half the ceiling is
always waited, so a flapping dependency is never hammered, and the other half
spreads replicas that failed at the same instant.

Hand-written rather than tenacity or stamina on purpose: both measure their
deadlines on ``time.monotonic``, while our waits run on the injected clock
(the event loop's, looptime's, or :class:`~controllerd.daemon.clock.ManualClock`),
and some callers must not retry at all (the lease keep-alive counts the
lease's life from one request). What they share is the schedule, which is
what this module holds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Final


@dataclass(frozen=True, slots=True)
class Backoff:
    """A retry schedule. ``delay(n)`` is the wait before retry ``n + 1`` (n from 0).

    Invariant: ``first / 2 <= delay(n) <= cap`` for every ``n``.
    """

    first: float
    cap: float
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"need 0 < first <= cap (first={self.first}, cap={self.cap})")

    def ceiling(self, attempt: int) -> float:
        """The longest wait before retry ``attempt + 1``."""
        # min() before the power would overflow for huge attempt counts.
        return min(self.cap, self.first * 2.0 ** min(attempt, 64))

    def delay(self, attempt: int) -> float:
        ceiling = self.ceiling(attempt)
        return self.rng.uniform(ceiling / 2, ceiling)

    def capped_at(self, cap: float) -> Backoff:
        """The same schedule with a lower (or higher) cap, e.g. an operator's interval."""
        return Backoff(min(self.first, cap), cap, self.rng)


#: etcd unary calls: etcd fails for about a second after a restart (DESIGN §7).
ETCD: Final = Backoff(0.05, 1.0)
#: Broker admin calls: 5xx storms and redirects to a leader that is moving.
BROKER: Final = Backoff(0.1, 5.0)
#: The audit producer reconnecting to Kafka.
KAFKA: Final = Backoff(0.1, 10.0)
#: A topic whose operation failed, evaluated again (capped at the autoscale interval).
TOPIC_RETRY: Final = Backoff(1.0, 60.0)
#: Campaigning again after etcd refused or failed a whole election attempt.
ELECTION: Final = Backoff(0.5, 10.0)
