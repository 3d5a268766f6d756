"""Broker admin REST client (DESIGN §5): split, merge, backlog, delete segment, topics.

One :class:`BrokerClient` (one ``httpx.AsyncClient``, one connection pool) per process.
It speaks Pulsar's scalable-topic admin paths and adapts to the broker's capabilities:

* ``profile="reference"`` (our reference broker): k-way splits with explicit
  ``?boundaries=``; fencing is enforced by the broker.
* ``profile="pulsar"``: only binary midpoint splits exist, so a k-way split becomes
  ``k - 1`` successive midpoint splits (see :meth:`BrokerClient.split`). The children
  are midpoint-aligned, *not* at the requested boundaries.

Error contract: every failure is a :class:`BrokerError` subclass carrying ``status``,
``method``, ``url`` and a truncated response ``body`` -- never the bearer token.
5xx, timeouts and connection errors are retried on the shared capped, jittered
schedule (:mod:`controllerd.adapters.backoff`), then raise :class:`BrokerUnavailable`;
a 4xx is never retried.

Retries of mutations are at-least-once, made idempotent by reading the layout: when an
attempt of a split or merge may have been applied before it failed (a 5xx, a timeout, a
dropped connection), the layout is read *before* the next attempt, and if it shows
exactly the requested outcome the call succeeds without sending it again. This matters
on Pulsar, which answers a split of a segment that is no longer active with 500, not
412 (its IllegalArgumentException becomes a RestException; pulsar-compat 3.7), so a
retry after a lost response would otherwise fail or, worse, split a child. A 412 is
reconciled the same way. Errors carry ``maybe_applied`` so callers can do the same for
other calls (e.g. a 409 from a retried ``create_topic``).

401 and 403 are :class:`Unauthorized`: on Pulsar, split, merge and every
``/admin/v2/segments`` call need a *superuser* token, and a tenant-admin token is
refused forever; the daemon surfaces it as an operator error, never a retry.

Redirects: writes (and, on Pulsar, segment reads) may answer 307/308 to the
controller-leader or owning broker. The client follows them itself rather than with
httpx's ``follow_redirects``, because httpx drops ``Authorization`` on a cross-origin
redirect (the leader is another host) and would turn a 302/303 POST into a GET. Only
307/308 are followed, method, body and headers intact; the bearer token is withheld
on an https -> http downgrade.

``TopicName`` is :class:`controllerd.core.model.TopicName`, re-exported so that the daemon,
the view and this client share one hashable type.
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Final, Literal, NamedTuple, Self
from urllib.parse import quote

import anyio
import httpx
import orjson

from controllerd.adapters import backoff
from controllerd.config import header_safe
from controllerd.core.layout import equal_boundaries
from controllerd.core.model import (
    HashRange,
    Layout,
    ModelError,
    Segment,
    TopicName,
    layout_from_json,
)
from controllerd.core.pulsar import rest_path_topic

__all__ = [
    "BrokerBug",
    "BrokerClient",
    "BrokerError",
    "BrokerProfile",
    "BrokerUnavailable",
    "Conflict",
    "Fenced",
    "Known",
    "NotFound",
    "PreconditionFailed",
    "RequestHook",
    "SubscriptionType",
    "TopicName",
    "Unaddressable",
    "Unauthorized",
    "as_profile",
]

BrokerProfile = Literal["pulsar", "reference"]
SubscriptionType = Literal["STREAM", "QUEUE"]


def as_profile(value: str) -> BrokerProfile:
    """Narrow a configured profile name (``BrokerSettings.profile`` is a plain str)."""
    if value == "pulsar":
        return "pulsar"
    if value == "reference":
        return "reference"
    raise ValueError(f"unknown broker profile {value!r}; expected pulsar or reference")


#: ``on_request(op, outcome, seconds, status)``: one call per logical operation (after
#: retries and redirects), for latency metrics. It must not raise.
RequestHook = Callable[[str, str, float, int | None], None]

MAX_REDIRECTS: Final = 5
BODY_LIMIT: Final = 512
"""Characters of a response body kept in an error (bodies can be whole stack traces)."""
#: Bytes of one broker answer, at most. A layout mirrors an etcd value (1.5 MiB by
#: default) and a backlog is a number: more is a broker that went wrong.
MAX_ANSWER_BYTES: Final = 16 * 1024 * 1024

FENCING_HEADER: Final = "X-Fencing-Token"
FENCING_KEY_HEADER: Final = "X-Fencing-Key"
"""Names the etcd key whose create revision the token is: the leader key, or a shard's."""
FENCED_CODE: Final = "fenced"
"""``code`` in a 409 body by which the reference broker says the fencing token is stale."""

_SCALABLE: Final = "/admin/v2/scalable"
_SEGMENTS: Final = "/admin/v2/segments"
_TOPIC_SCHEME: Final = "topic://"
_REDIRECTS: Final = frozenset({307, 308})


# --- errors -----------------------------------------------------------------


class BrokerError(Exception):
    """An admin call failed. ``url`` has no credentials; ``body`` is truncated.

    ``status`` is None when no response arrived (timeout, connection error).
    ``code`` is the machine-readable ``code`` of a JSON error body (reference broker),
    if any. ``maybe_applied`` is True when an earlier attempt of this call may have
    taken effect before failing, so a 404/409/412 may be the echo of our own success.
    """

    outcome: ClassVar[str] = "error"

    def __init__(
        self,
        message: str,
        *,
        method: str,
        url: str,
        status: int | None = None,
        body: str = "",
        code: str | None = None,
        maybe_applied: bool = False,
    ) -> None:
        detail = f"{method} {url}: {message}"
        if body:
            detail += f" -- {body}"
        super().__init__(detail)
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        self.code = code
        self.maybe_applied = maybe_applied


class NotFound(BrokerError):
    """404: the topic, segment or subscription does not exist."""

    outcome = "not_found"


class Conflict(BrokerError):
    """409: already exists; on the reference broker also "segment still has backlog"."""

    outcome = "conflict"


class Fenced(Conflict):
    """409 with code ``fenced``: the broker saw a newer leader's fencing token.

    The caller has been deposed and must stop acting; it is a :class:`Conflict` so
    code that only knows Pulsar's statuses still treats it as a refusal.
    """

    outcome = "fenced"


class PreconditionFailed(BrokerError):
    """412: the layout changed under us (segment not active, not adjacent, bad split)."""

    outcome = "precondition_failed"


class BrokerBug(BrokerError):
    """Any other 4xx, an unexpected redirect or an unparsable answer: report, don't retry."""

    outcome = "bug"


class Unauthorized(BrokerBug):
    """401/403: the broker refuses our credentials for this call; retrying cannot help.

    Pulsar needs a superuser token for split, merge and ``/admin/v2/segments``.
    """

    outcome = "unauthorized"


class Unaddressable(BrokerBug):
    """The topic's name cannot be carried by this broker's REST paths (Pulsar decodes
    the topic path only on create: a name that needs escaping can never be split)."""

    outcome = "unaddressable"


class BrokerUnavailable(BrokerError):
    """5xx, timeouts or connection errors persisted through every retry."""

    outcome = "unavailable"


_BY_STATUS: Final[dict[int, type[BrokerError]]] = {
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    412: PreconditionFailed,
}


class _Retryable(Exception):
    """One attempt failed transiently; carries what the final error should report."""

    def __init__(self, message: str, status: int | None, body: str, applied: bool) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.applied = applied


# --- the client ---------------------------------------------------------------


def _seg(value: str | int) -> str:
    """One URL path segment, percent-encoded (topic names may hold ``%``, ``:`` etc.)."""
    return quote(str(value), safe="")


def _topic_path(topic: TopicName, local_name: str) -> str:
    return f"{_SCALABLE}/{_seg(topic.tenant)}/{_seg(topic.namespace)}/{local_name}"


def _segment_path(topic: TopicName, local_name: str, descriptor: str) -> str:
    return (
        f"{_SEGMENTS}/{_seg(topic.tenant)}/{_seg(topic.namespace)}/{local_name}/{_seg(descriptor)}"
    )


def _ssl_context(
    ca_file: str | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_file)
    if cert_file is not None:
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


class BrokerClient:
    """Async client for the broker admin REST API (see the module docstring).

    Args:
        base_url: admin URL of any broker, e.g. ``https://broker:8443``.
        profile: broker dialect; decides how k-way splits are carried out.
        token: bearer token (the caller reads ``token_file``); see :meth:`set_token`.
        ca_file, cert_file, key_file: PEM files for TLS and mutual TLS, read once here.
        timeout: seconds per attempt, redirects included (a hard deadline).
        max_retries: extra attempts after a transient failure; 0 = try once.
        transport: httpx transport to use instead of the network (tests).
        sleep, rng: backoff sleep and jitter source, injectable so tests never sleep.
        on_request: metrics hook, see :data:`RequestHook`.
    """

    def __init__(
        self,
        base_url: str,
        *,
        profile: BrokerProfile = "pulsar",
        token: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        timeout: float = 10.0,
        max_retries: int = 5,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
        on_request: RequestHook | None = None,
    ) -> None:
        profile = as_profile(profile)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"broker admin URL must be http(s)://host[:port], got {base_url!r}")
        self.profile: BrokerProfile = profile
        self._base_scheme = url.scheme
        self._token: str | None = None
        self.set_token(token)
        self._timeout = timeout
        self._max_retries = max_retries
        self._sleep = sleep
        self._backoff_schedule = backoff.Backoff(
            backoff.BROKER.first, backoff.BROKER.cap, rng if rng is not None else random.Random()
        )
        self._on_request = on_request
        verify: ssl.SSLContext | bool = True
        if url.scheme == "https" or ca_file is not None or cert_file is not None:
            verify = _ssl_context(ca_file, cert_file, key_file)
        self._client = httpx.AsyncClient(
            base_url=url,
            transport=transport,
            verify=verify,
            timeout=httpx.Timeout(timeout),
            follow_redirects=False,
            headers={
                "Accept": "application/json",
                "Accept-Encoding": "identity",  # what _read_capped counts is what it keeps
                "User-Agent": "controllerd",
            },
        )

    def _local_name(self, topic: TopicName) -> str:
        """The topic's name as this broker's REST paths must carry it.

        Pulsar's scalable-topic endpoints never decode the path (except on create;
        pulsar-compat 1.2), so the name goes unescaped and a name that needs
        escaping cannot be addressed at all; the reference broker decodes, so the
        name is percent-encoded once. Never twice: names come decoded from the view.
        """
        if self.profile != "pulsar":
            return _seg(topic.topic)
        try:
            return rest_path_topic(topic.topic)
        except ModelError as exc:
            raise Unaddressable(str(exc), method="-", url=f"{_SCALABLE}/{topic}") from None

    def _topic_path(self, topic: TopicName) -> str:
        return _topic_path(topic, self._local_name(topic))

    def _segment_path(self, topic: TopicName, descriptor: str) -> str:
        return _segment_path(topic, self._local_name(topic), descriptor)

    def set_token(self, token: str | None) -> bool:
        """Replace the bearer token (SIGHUP rotation); surrounding whitespace is dropped.
        True if it differs from the one before."""
        if token is not None:
            token = token.strip()
            if not token or not header_safe(token):
                raise ValueError("bearer token must be one line of printable ASCII")
        changed = token != self._token
        self._token = token
        return changed

    async def aclose(self) -> None:
        """Close the connection pool; safe to call twice."""
        await self._client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- topics and subscriptions ---------------------------------------------

    async def list_topics(self, tenant: str, namespace: str) -> list[str]:
        """Names ``t/ns/topic`` of the namespace's scalable topics, for ``TopicName.parse``.

        Pulsar answers ``topic://t/ns/topic``; the ``topic://`` scheme is dropped.
        """
        path = f"{_SCALABLE}/{_seg(tenant)}/{_seg(namespace)}"
        response = await self._call("list_topics", "GET", path)
        names = self._json(response)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise self._bad_answer(response, "expected a JSON list of topic names")
        return [n.removeprefix(_TOPIC_SCHEME) for n in names]

    async def create_topic(
        self, topic: TopicName, num_initial_segments: int, *, fencing_token: int | None = None
    ) -> None:
        """Create a scalable topic; :class:`Conflict` if it exists."""
        await self._call(
            "create_topic",
            "PUT",
            self._topic_path(topic),
            params={"numInitialSegments": str(num_initial_segments)},
            fencing_token=fencing_token,
        )

    async def get_layout(self, topic: TopicName, *, retry: bool = True) -> Layout:
        """The topic's layout; invariants are *not* checked (see ``layout.violations``).

        ``retry=False`` makes one attempt: reconciliation asks between the
        retries of a mutation and must not multiply them.
        """
        response = await self._call(
            "get_layout", "GET", self._topic_path(topic), retries=None if retry else 0
        )
        try:
            return layout_from_json(self._json(response))
        except ModelError as exc:
            raise self._bad_answer(response, f"unusable layout: {exc}") from exc

    async def delete_topic(
        self, topic: TopicName, force: bool = False, *, fencing_token: int | None = None
    ) -> None:
        await self._call(
            "delete_topic",
            "DELETE",
            self._topic_path(topic),
            params={"force": "true" if force else "false"},
            fencing_token=fencing_token,
        )

    async def create_subscription(
        self,
        topic: TopicName,
        subscription: str,
        type: SubscriptionType = "STREAM",
        *,
        fencing_token: int | None = None,
    ) -> None:
        """Create a subscription with cursors at the earliest position on every active
        segment (Pulsar ``createSubscriptionOnActiveSegments``)."""
        await self._call(
            "create_subscription",
            "PUT",
            f"{self._topic_path(topic)}/subscriptions/{_seg(subscription)}",
            params={"type": type},
            fencing_token=fencing_token,
        )

    async def delete_subscription(
        self, topic: TopicName, subscription: str, *, fencing_token: int | None = None
    ) -> None:
        await self._call(
            "delete_subscription",
            "DELETE",
            f"{self._topic_path(topic)}/subscriptions/{_seg(subscription)}",
            fencing_token=fencing_token,
        )

    # --- split and merge --------------------------------------------------------

    async def split(
        self,
        topic: TopicName,
        segment_id: int,
        boundaries: Sequence[int] | None,
        *,
        fencing_token: int | None,
        fencing_key: str | None = None,
        known: Known | None = None,
    ) -> None:
        """Split an active segment into ``len(boundaries) + 1`` children (None: 2, midpoint).

        ``known``: the segment's range and the layout's ``nextSegmentId`` when the
        caller decided, so that an applied split is recognised even after the
        parent was pruned (Pulsar's GC prunes drained parents within its interval).

        Reference profile: one request with ``?boundaries=b1,b2,...`` (decimal).

        Pulsar profile: the broker only splits at the midpoint, so the first request
        splits ``segment_id`` and each further one splits the widest child made so far
        (ties -> lower id), re-reading the layout in between, until the parent's range
        is covered by ``len(boundaries) + 1`` children. The children are therefore
        midpoint-aligned, not at the requested boundaries (a 4-way split gives exact
        quarters, a 3-way one a half and two quarters). Each step is a valid layout,
        so a failure part-way leaves a partial split for the next decision to build on.
        """
        bounds = None if boundaries is None else tuple(boundaries)
        if bounds is not None and not bounds:
            raise ValueError("a split needs at least one boundary (or None for the midpoint)")
        fence = (fencing_token, fencing_key)
        if self.profile == "reference":
            await self._split_once(topic, segment_id, bounds, fence, known)
            return
        await self._split_once(topic, segment_id, None, fence, known)
        wanted = 2 if bounds is None else len(bounds) + 1
        if wanted == 2:
            return
        layout = await self._layout_after_split(topic, segment_id)
        first = layout.segments.get(segment_id)
        if first is None and known is None:
            return  # pruned already and we cannot tell its range: the policy re-decides
        parent = first.hash_range if first is not None else known[0]  # type: ignore[index]
        for _ in range(wanted - 2):
            pieces = [
                s
                for s in layout.active_segments()
                if parent.start <= s.hash_range.start and s.hash_range.end <= parent.end
            ]
            if not pieces or len(pieces) >= wanted:
                return  # done, or someone else reshaped the range: the policy re-decides
            widest = min(pieces, key=lambda s: (-s.hash_range.width, s.segment_id))
            step = Known(widest.hash_range, layout.next_segment_id)
            await self._split_once(topic, widest.segment_id, None, fence, step)
            layout = await self._layout_after_split(topic, widest.segment_id)

    async def merge(
        self,
        topic: TopicName,
        a: int,
        b: int,
        *,
        fencing_token: int | None,
        fencing_key: str | None = None,
        known: Known | None = None,
    ) -> None:
        """Merge two adjacent active segments into one (``known``: their joint range)."""

        async def applied() -> bool:
            return await self._merge_applied(topic, a, b, known)

        try:
            await self._call(
                "merge",
                "POST",
                f"{self._topic_path(topic)}/merge/{a}/{b}",
                fencing_token=fencing_token,
                fencing_key=fencing_key,
                reconcile=applied,
            )
        except (PreconditionFailed, BrokerUnavailable) as exc:
            if not (exc.maybe_applied and await self._quietly(applied)):
                raise

    # --- segments ---------------------------------------------------------------

    async def backlog(self, topic: TopicName, descriptor: str, subscription: str) -> int | None:
        """Unconsumed entries of ``subscription`` on one segment; None on 404 (= not drained).

        A 404 means the segment topic is not loaded or the cursor does not exist: GC
        must treat that as "not drained" and ask again later.
        """
        path = f"{self._segment_path(topic, descriptor)}/subscription/{_seg(subscription)}/backlog"
        response = await self._call("backlog", "GET", path, allow=frozenset({404}))
        if response.status_code == 404:
            return None
        value = self._json(response)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad_answer(response, "expected a bare number")
        if isinstance(value, float) and not value.is_integer():
            raise self._bad_answer(response, "expected an integer backlog")
        return int(value)

    async def delete_segment(
        self,
        topic: TopicName,
        descriptor: str,
        *,
        fencing_token: int | None,
        fencing_key: str | None = None,
    ) -> bool:
        """Delete a pruned segment's data: True if deleted, False if it was already gone.

        :class:`Conflict` from the reference broker means the segment still has backlog.
        """
        response = await self._call(
            "delete_segment",
            "DELETE",
            self._segment_path(topic, descriptor),
            params={"force": "true"},
            fencing_token=fencing_token,
            fencing_key=fencing_key,
            allow=frozenset({404}),
        )
        return response.status_code != 404

    # --- split/merge helpers ------------------------------------------------------

    async def _split_once(
        self,
        topic: TopicName,
        segment_id: int,
        bounds: tuple[int, ...] | None,
        fence: tuple[int | None, str | None],
        known: Known | None,
    ) -> None:
        params = None if bounds is None else {"boundaries": ",".join(str(b) for b in bounds)}

        async def applied() -> bool:
            return await self._split_applied(topic, segment_id, bounds, known)

        try:
            await self._call(
                "split",
                "POST",
                f"{self._topic_path(topic)}/split/{segment_id}",
                params=params,
                fencing_token=fence[0],
                fencing_key=fence[1],
                reconcile=applied,
            )
        except (PreconditionFailed, BrokerUnavailable) as exc:
            if not (exc.maybe_applied and await self._quietly(applied)):
                raise

    async def _quietly(self, applied: Callable[[], Awaitable[bool]]) -> bool:
        """Whether the layout shows an operation applied; False when it cannot be read."""
        try:
            return await applied()
        except BrokerError:
            return False

    async def _split_applied(
        self, topic: TopicName, segment_id: int, bounds: tuple[int, ...] | None, known: Known | None
    ) -> bool:
        """Whether the layout shows ``segment_id`` split exactly as requested.

        From the parent's links while it is there; once it was pruned, from the
        children: segments created after ``known.next_segment_id`` that cover
        exactly the requested pieces of ``known.hash_range``.
        """
        layout = await self.get_layout(topic, retry=False)
        parent = layout.segments.get(segment_id)
        if parent is not None:
            if parent.active:
                return False
            rng = parent.hash_range
            expected = bounds if bounds is not None else equal_boundaries(rng, 2)
            children = _children(layout, parent)
            if [c.hash_range.start for c in children] == [rng.start, *expected] and all(
                c.parent_ids == (segment_id,) for c in children
            ):
                return True
        if known is None:
            return False
        rng = known.hash_range
        cuts = bounds if bounds is not None else equal_boundaries(rng, 2)
        pieces = zip((rng.start, *cuts), (*(c - 1 for c in cuts), rng.end), strict=True)
        return set(pieces) <= _created_since(layout, known.next_segment_id)

    async def _merge_applied(self, topic: TopicName, a: int, b: int, known: Known | None) -> bool:
        """Whether the layout shows ``a`` and ``b`` sealed into one common child
        (or, once they were pruned, a segment created since that covers both)."""
        layout = await self.get_layout(topic, retry=False)
        first, second = layout.segments.get(a), layout.segments.get(b)
        if first is not None and second is not None:
            if first.active or second.active:
                return False
            if len(first.child_ids) == 1 and first.child_ids == second.child_ids:
                child = layout.segments.get(first.child_ids[0])
                if child is not None and set(child.parent_ids) == {a, b}:
                    return True
        if known is None:
            return False
        rng = known.hash_range
        return (rng.start, rng.end) in _created_since(layout, known.next_segment_id)

    async def _layout_after_split(self, topic: TopicName, segment_id: int) -> Layout:
        """Read the layout until it shows ``segment_id`` sealed.

        Pulsar serves reads from a per-broker metadata cache, so a read right after a
        split acknowledged by the leader may still show the old layout.
        """
        for attempt in range(self._max_retries + 1):
            layout = await self.get_layout(topic)
            seg = layout.segments.get(segment_id)
            if seg is None or not seg.active:  # sealed, or already pruned by Pulsar's GC
                return layout
            if attempt < self._max_retries:
                await self._sleep(self._backoff(attempt))
        raise BrokerUnavailable(
            f"layout still shows segment {segment_id} active after it was split",
            method="GET",
            url=_safe(self._client.base_url.join(self._topic_path(topic).lstrip("/"))),
        )

    # --- transport ----------------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        """The shared schedule (:data:`controllerd.adapters.backoff.BROKER`)."""
        return self._backoff_schedule.delay(attempt)

    async def _call(
        self,
        op: str,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        fencing_token: int | None = None,
        fencing_key: str | None = None,
        allow: frozenset[int] = frozenset(),
        reconcile: Callable[[], Awaitable[bool]] | None = None,
        retries: int | None = None,
    ) -> httpx.Response:
        """Send with retries; return a 2xx (or an ``allow``-ed status) response, else raise.

        ``reconcile`` (mutations): before retrying an attempt that may have been
        applied, it is asked whether it was; if so no retry is sent.
        """
        started = anyio.current_time()
        url = self._client.base_url.join(path.lstrip("/"))
        if params:
            url = url.copy_merge_params(params)
        fence = (fencing_token, fencing_key)
        try:
            response, maybe_applied = await self._send_with_retries(
                method, url, fence, reconcile, self._max_retries if retries is None else retries
            )
            if not (response.is_success or response.status_code in allow):
                raise self._error(response, method, maybe_applied=maybe_applied)
        except BrokerError as exc:
            self._report(op, exc.outcome, started, exc.status)
            raise
        self._report(op, _outcome(response.status_code), started, response.status_code)
        return response

    def _report(self, op: str, outcome: str, started: float, status: int | None) -> None:
        if self._on_request is not None:
            self._on_request(op, outcome, anyio.current_time() - started, status)

    async def _send_with_retries(
        self,
        method: str,
        url: httpx.URL,
        fence: tuple[int | None, str | None],
        reconcile: Callable[[], Awaitable[bool]] | None,
        max_retries: int,
    ) -> tuple[httpx.Response, bool]:
        """The first non-5xx response, and whether an earlier attempt may have been applied."""
        maybe_applied = False
        last: _Retryable | None = None
        for attempt in range(max_retries + 1):
            if attempt:
                await self._sleep(self._backoff(attempt - 1))
                if maybe_applied and reconcile is not None and await self._quietly(reconcile):
                    # Applied by an attempt whose answer we lost: done, send nothing again.
                    request = self._client.build_request(method, url)
                    return httpx.Response(204, request=request), True
            try:
                response = await self._attempt(method, url, fence)
            except _Retryable as exc:
                last = exc
                maybe_applied = maybe_applied or exc.applied
                continue
            if response.status_code >= 500:
                last = _Retryable(
                    f"HTTP {response.status_code}",
                    response.status_code,
                    self._body(response),
                    applied=True,
                )
                maybe_applied = True
                continue
            return response, maybe_applied
        assert last is not None
        raise BrokerUnavailable(
            f"{last} (gave up after {max_retries + 1} attempts)",
            method=method,
            url=_safe(url),
            status=last.status,
            body=last.body,
            maybe_applied=maybe_applied,
        ) from last.__cause__

    async def _attempt(
        self, method: str, url: httpx.URL, fence: tuple[int | None, str | None]
    ) -> httpx.Response:
        """One attempt, following 307/308 redirects, within one ``timeout`` deadline.

        Raises :class:`_Retryable` for timeouts and connection errors, and
        :class:`BrokerBug` for requests that can never succeed.
        """
        try:
            with anyio.fail_after(self._timeout):
                for _ in range(MAX_REDIRECTS + 1):
                    request = self._client.build_request(
                        method,
                        url,
                        headers=self._headers(url, method, fence),
                        content=b"" if method in ("PUT", "POST") else None,
                    )
                    response = await self._read_capped(request, method)
                    location = response.headers.get("location")
                    if response.status_code not in _REDIRECTS or not location:
                        return response
                    url = url.join(location)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise _Retryable(f"timed out after {self._timeout}s", None, "", True) from exc
        except httpx.ConnectError as exc:
            raise _Retryable(f"cannot connect: {exc}", None, "", False) from exc
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Retryable(f"connection failed: {exc}", None, "", True) from exc
        except (httpx.TransportError, ValueError) as exc:
            # ValueError: a header httpx cannot encode (UnicodeEncodeError); config and
            # secrets are checked for it, so this is a last guard that keeps it a refusal
            raise BrokerBug(
                f"request cannot be sent: {type(exc).__name__}: {exc}",
                method=method,
                url=_safe(url),
            ) from exc
        raise _Retryable(f"more than {MAX_REDIRECTS} redirects", None, "", True)

    async def _read_capped(self, request: httpx.Request, method: str) -> httpx.Response:
        """Send ``request`` and read its answer, refusing one over :data:`MAX_ANSWER_BYTES`.

        Read whole, a 500 MB answer took that much memory (2.5 GB over the retries of
        a 500) and stalled the loop parsing it. The client asks for no compression
        (``Accept-Encoding: identity``), so the bytes counted are the bytes kept.
        """
        response = await self._client.send(request, stream=True)
        too_big = BrokerBug(
            f"answer larger than {MAX_ANSWER_BYTES:,} bytes",
            method=method,
            url=_safe(request.url),
            status=response.status_code,
        )
        if response.is_stream_consumed:  # a transport that answered with its content read
            if len(response.content) > MAX_ANSWER_BYTES:
                raise too_big
            return response
        try:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise too_big
                chunks.append(chunk)
        finally:
            await response.aclose()
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=b"".join(chunks),
            request=request,
        )

    def _headers(
        self, url: httpx.URL, method: str, fence: tuple[int | None, str | None]
    ) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self._token is not None and (url.scheme == "https" or self._base_scheme == "http"):
            headers["Authorization"] = f"Bearer {self._token}"
        fencing_token, fencing_key = fence
        if fencing_token is not None and method != "GET":
            headers[FENCING_HEADER] = str(fencing_token)
            if fencing_key:
                headers[FENCING_KEY_HEADER] = fencing_key
        if method in ("PUT", "POST"):
            # Pulsar's Java admin client sends an empty JSON entity: Jersey rejects an
            # entity-taking resource (create topic) without a JSON content type.
            headers["Content-Type"] = "application/json"
        return headers

    def _body(self, response: httpx.Response) -> str:
        text = response.text.strip()
        if self._token:
            text = text.replace(self._token, "<redacted>")
        if len(text) > BODY_LIMIT:
            text = text[:BODY_LIMIT] + "..."
        return text

    def _error(self, response: httpx.Response, method: str, *, maybe_applied: bool) -> BrokerError:
        status = response.status_code
        body = self._body(response)
        code = _error_code(response)
        cls = _BY_STATUS.get(status, BrokerBug)
        if cls is Conflict and code == FENCED_CODE:
            cls = Fenced
        return cls(
            f"HTTP {status}",
            method=method,
            url=_safe(response.request.url),
            status=status,
            body=body,
            code=code,
            maybe_applied=maybe_applied,
        )

    def _json(self, response: httpx.Response) -> Any:
        """The answer as strict JSON (orjson): the stdlib parser raised RecursionError, which
        no caller handles, on an answer nested past Python's recursion limit."""
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise self._bad_answer(response, "response is not JSON") from exc

    def _bad_answer(self, response: httpx.Response, why: str) -> BrokerBug:
        return BrokerBug(
            why,
            method=response.request.method,
            url=_safe(response.request.url),
            status=response.status_code,
            body=self._body(response),
        )


class Known(NamedTuple):
    """What the caller knew when it decided: the range at stake and ``nextSegmentId``.

    Segments with an id at or above it were created after the decision, which is
    how an applied operation is recognised once Pulsar's GC pruned its parents.
    """

    hash_range: HashRange
    next_segment_id: int


def _created_since(layout: Layout, next_segment_id: int) -> set[tuple[int, int]]:
    """Ranges of the segments created at or after ``next_segment_id``."""
    return {
        (s.hash_range.start, s.hash_range.end)
        for s in layout.segments.values()
        if s.segment_id >= next_segment_id
    }


def _children(layout: Layout, parent: Segment) -> list[Segment]:
    found = [layout.segments[c] for c in parent.child_ids if c in layout.segments]
    return sorted(found, key=lambda s: s.hash_range.start)


def _outcome(status: int) -> str:
    """The ``on_request`` outcome of a response the caller accepted."""
    cls = _BY_STATUS.get(status)
    return "ok" if status < 300 or cls is None else cls.outcome


def _error_code(response: httpx.Response) -> str | None:
    try:
        payload = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    code = payload.get("code") if isinstance(payload, dict) else None
    return code if isinstance(code, str) else None


def _safe(url: httpx.URL) -> str:
    """The URL without user info, for error messages."""
    return str(url.copy_with(username=None, password=None)) if url.userinfo else str(url)
