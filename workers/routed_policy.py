"""A job's view of the backend fleet: every request goes where the pool routes it.

`RoutedPolicy` is what the agent loop talks to (the policy and the templater both). Before
each request it asks the pool where the job's requests go — the same backend while it takes
work (sticky, so the prefix cache is reused), the least-loaded one once it is drained or lost —
and after each request it gives up a backend that no longer takes work, so a drained backend
is idle as soon as its running requests end. Templating and decoding, which every backend of
the pool answers alike, go to the backend the job holds without a routing round trip. A
request lost with its backend (connection refused or reset, no answer, or a 5xx after the
client's own retries) marks that backend dead and is re-sent elsewhere: the turn is not lost,
its prompt simply prefills on the new backend. While no backend takes work (every one
draining for a weight update) the job waits between turns, up to `backend_wait` seconds. A
4xx is the request's fault and is raised as it is, the backend left alone: a prompt refused
for an id outside the vocabulary (`routing.vllm.OutOfVocabularyError`) ends the episode in the
agent loop, not the backend.

The job's liveness is checked before each request and every `poll` seconds while one runs: a
cancelled job's in-flight request is aborted (its HTTP connection closed, which is how vLLM
aborts; SGLang is also sent `/abort_request`) and `JobCancelled` ends the episode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from core.schemas import Backend
from routing.chat import ChatTemplater
from routing.pool import BackendPool, JobEnded, NoHealthyBackendError
from routing.protocol import Completion
from routing.vllm import BackendError
from workers.aio import settle

log = logging.getLogger(__name__)
T = TypeVar("T")


class JobCancelled(Exception):
    """The job was ended from outside (cancelled, or its batch reached its target)."""


class StalePolicy(Exception):
    """The job's turns come (or would come) from a policy older than its `max_staleness`
    allows: `oldest < current - max_staleness`."""

    def __init__(self, job_id: str, oldest: int, current: int, max_staleness: int) -> None:
        super().__init__(
            f"job {job_id} has turns from policy version {oldest}, but the current version is "
            f"{current} and agent.max_staleness is {max_staleness}"
        )
        self.oldest = oldest
        self.current = current


def check_staleness(
    job_id: str, versions: Iterable[int | None], current: int | None, max_staleness: int | None
) -> None:
    """Raise `StalePolicy` when the oldest of `versions` (None: unversioned, never stale) is
    more than `max_staleness` behind `current`."""
    known = [v for v in versions if v is not None]
    if max_staleness is None or current is None or not known:
        return
    oldest = min(known)
    if oldest < current - max_staleness:
        raise StalePolicy(job_id, oldest, current, max_staleness)


def cache_salt(policy_version: int | None) -> str | None:
    """The prefix-cache salt of requests generated with a policy version: prefixes computed
    under older weights are never reused for a newer version."""
    return None if policy_version is None else f"rollserve-policy-{policy_version}"


ClientsOf = Callable[[Backend], tuple[Any, ChatTemplater]]
"""The inference client and templater of a backend (kept per worker process)."""


POLL_SECONDS = 0.25
"""How often a running request checks that its job is still live: a cancel reaches the engine
within about this long (one Redis read per request in flight each time)."""


class RoutedPolicy:
    """Policy client and templater of one job, routed through the backend pool."""

    def __init__(
        self,
        pool: BackendPool,
        job_id: str,
        clients_of: ClientsOf,
        *,
        is_live: Callable[[], bool] = lambda: True,
        job_key: str | None = None,
        final: Iterable[str] = (),
        backend_wait: float = 600.0,
        failovers: int = 3,
        poll: float = POLL_SECONDS,
        max_staleness: int | None = None,
        offload: bool = False,
    ) -> None:
        self.pool = pool
        self.job_id = job_id
        self.clients_of = clients_of
        self.is_live = is_live
        self.job_key = job_key
        """With it, routing checks the job's status in the same round trip (`final` are the
        statuses that end it); `is_live` is then asked only while a request runs."""
        self.final = tuple(final)
        self.backend_wait = backend_wait
        self.failovers = failovers
        self.poll = poll
        self.backend: Backend | None = None
        """The backend of the latest request."""
        self.moves = 0
        self._requests = 0
        self.max_staleness = max_staleness
        self.offload = offload
        """Make the pool's Redis calls on a thread, not on the event loop: where one loop
        runs many jobs (`workers.jobsloop`), a blocking call would stall all of them."""
        self.oldest_version: int | None = None
        """The oldest policy version among the turns generated so far."""

    # ------------------------------------------------------------------ routing

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a call to the pool's Redis), on a thread when offloading."""
        if self.offload:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _check_live(self) -> None:
        if not self.is_live():
            raise JobCancelled(f"job {self.job_id} is no longer live")

    async def _route(self) -> tuple[Backend, Any, ChatTemplater]:
        """The job's backend now, waiting while none takes work."""
        deadline = time.monotonic() + self.backend_wait
        delay = 0.05
        while True:
            if self.job_key is None:
                self._check_live()
            try:
                route = await self._io(self.pool.route, self.job_id, self.job_key, self.final)
            except JobEnded:
                raise JobCancelled(f"job {self.job_id} is no longer live") from None
            except NoHealthyBackendError:
                if time.monotonic() >= deadline:
                    raise NoHealthyBackendError(
                        f"no backend took work for {self.backend_wait:g}s "
                        "(all draining or dead); raise ROLLSERVE_BACKEND_WAIT to wait longer"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
                continue
            backend = self.backend
            if backend is not None and (backend.id, backend.url) == (route.backend_id, route.url):
                # Sticky: the same registration; only its policy version may have moved on.
                if backend.policy_version != route.policy_version:
                    backend = backend.model_copy(update={"policy_version": route.policy_version})
            else:
                backend = await self._io(self.pool.get, route.backend_id)
                if backend is None:  # removed just now: route again
                    continue
            if route.moved:
                self.moves += 1
                log.info("job %s moved from %s to %s", self.job_id, route.left, backend.id)
            self.backend = backend
            client, templater = self.clients_of(backend)
            return backend, client, templater

    async def _watched(self, work: Awaitable[T], on_cancel: Callable[[], Awaitable[None]]) -> T:
        """`work`, cancelled (and `on_cancel` awaited) as soon as the job stops being live.

        Offloading (many jobs on one loop), the loop's watch cancels an ended job's task
        itself: no poll per request, only the engine told on cancellation."""
        if self.offload:
            try:
                return await work
            except asyncio.CancelledError:
                await settle(on_cancel(), timeout=5)
                raise
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.poll)
                if done:
                    return task.result()
                if not self.is_live():
                    task.cancel()
                    await settle(task)
                    await settle(on_cancel())
                    raise JobCancelled(f"job {self.job_id} was cancelled during a request")
        except asyncio.CancelledError:
            # The job's own task was cancelled (a many-jobs worker ends jobs so): the engine
            # is told too, as it is when the poll finds the job ended.
            task.cancel()
            await settle(on_cancel(), timeout=5)
            raise
        finally:
            if not task.done():
                task.cancel()

    async def _with_failover(
        self, call: Callable[[Backend, Any, ChatTemplater], Awaitable[T]], *, route: bool = True
    ) -> T:
        """Run `call` on the job's backend; when the backend is lost, mark it dead and run it
        again on the one the job moves to (at most `failovers` times). Without `route`, a
        job that has a backend already asks it directly, without a routing round trip (for
        templating and decoding, which every backend of the pool answers alike), and is
        routed only when that fails."""
        if not route and self.backend is not None:
            client, templater = self.clients_of(self.backend)
            try:
                return await call(self.backend, client, templater)
            except BackendError as exc:
                if not exc.retryable:
                    raise
                # Lost, or busy loading weights: route as any request does (and wait there).
        attempt = 0
        while True:
            backend, client, templater = await self._route()
            try:
                return await call(backend, client, templater)
            except BackendError as exc:
                # Still failing after the client's own retries: no answer, or 5xx (vLLM
                # answers 500 once its engine died). The health checks re-admit the backend
                # as soon as it answers `/health` again. A 4xx is the request's fault.
                if not exc.retryable or attempt >= self.failovers:
                    raise
                attempt += 1
                await self._io(self.pool.mark_dead, backend.id)
                log.warning(
                    "job %s lost backend %s (%s); marked it dead and re-sending elsewhere",
                    self.job_id,
                    backend.id,
                    exc,
                )

    # ------------------------------------------------------------------ policy client

    async def complete(self, prompt_ids: list[int], **params: Any) -> Completion:
        """One model call on the job's backend, with the salt of its policy version."""

        async def call(backend: Backend, client: Any, _t: ChatTemplater) -> Completion:
            if self.max_staleness is not None:
                current = await self._io(self.pool.current_version)
                self.check_staleness(backend.policy_version, current)
            self._requests += 1
            request_id = f"{self.job_id}-{self._requests}"
            try:
                completion: Completion = await self._watched(
                    client.complete(
                        prompt_ids,
                        cache_salt=cache_salt(backend.policy_version),
                        request_id=request_id,
                        **params,
                    ),
                    lambda: client.abort(request_id),
                )
            finally:
                await self._io(self.pool.request_done, self.job_id)
            completion.backend_id = backend.id
            completion.policy_version = version = backend.policy_version
            if version is not None and (
                self.oldest_version is None or version < self.oldest_version
            ):
                self.oldest_version = version
            return completion

        return await self._with_failover(call)

    def check_staleness(self, next_version: int | None = None, current: int | None = None) -> None:
        """Raise `StalePolicy` if the turns so far, with one more from `next_version`, are
        older than `max_staleness` allows against the `current` version (read from the pool,
        one Redis read, when not given; nothing without a bound)."""
        if self.max_staleness is None:
            return
        versions = (self.oldest_version, next_version)
        if current is None:
            current = self.pool.current_version()
        check_staleness(self.job_id, versions, current, self.max_staleness)

    def first_refused(self, ids: list[int]) -> int | None:
        """The first of `ids` the job's backend is known to refuse in a prompt (outside its
        vocabulary, learnt from an earlier refusal by this worker's client), if any."""
        if self.backend is None:
            return None
        client, _ = self.clients_of(self.backend)
        first_refused = getattr(client, "first_refused", None)
        if first_refused is None:
            return None
        found: int | None = first_refused(ids)
        return found

    async def max_model_len(self) -> int:
        async def call(_b: Backend, client: Any, _t: ChatTemplater) -> int:
            return int(await client.max_model_len())

        return await self._with_failover(call)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of `ids` as the job's backend decodes them (special tokens included)."""

        async def call(_b: Backend, client: Any, _t: ChatTemplater) -> str:
            return str(await client.detokenize(ids))

        return await self._with_failover(call, route=False)

    # ------------------------------------------------------------------ templater

    async def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        async def call(_b: Backend, _c: Any, templater: ChatTemplater) -> list[int]:
            return await templater.prompt_ids(messages, tools)

        return await self._with_failover(call, route=False)

    async def continuation_ids(
        self,
        last_output_ids: list[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        async def call(_b: Backend, _c: Any, templater: ChatTemplater) -> list[int]:
            return await templater.continuation_ids(last_output_ids, messages, tools)

        return await self._with_failover(call, route=False)
