"""The asyncio face of RolloutClient, for trainers built on an event loop
(many generate() calls at once, aborts and pauses from other tasks).

One receiver thread per connection reads every result and routes it by
request id to the call that waits for it, so any number of concurrent calls
each get exactly their own samples, each once. Calls answered by a reply
(hello, stats, pause, abort, updates) run on a small pool of worker threads
(the C client is thread-safe), so awaiting never blocks the loop.
"""
import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Dict, List, Optional, Sequence

from ._types import ClientError, DeadlineExceeded, SampleResult, ServerError, TokenDelta

# The receiver's longest wait before it looks whether it should stop.
SLICE_MS = 200
# How long a call whose deadline passed waits for the samples its abort
# ended (they came before the abort's reply; this only covers the hand-over).
ABORT_GRACE_S = 5.0


class _Route:
    """Where the results of one call's requests go."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deltas: bool):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.deltas = deltas


class AsyncRolloutClient:
    """RolloutClient's methods as coroutines: hello, stats, pause, resume, abort,
    submit, results, update_weights; generate() returns every sample of its
    prompts, stream() yields them as they finish, stream_tokens() with their
    token deltas. Use `async with AsyncRolloutClient(addr) as c:`.

    Any number of these calls may run at once (asyncio.gather): each gets the
    samples of its own requests, each once. abort() and pause("abort") from
    another task end samples that then come out of the calls that wait for
    them with finish_reason "abort" and what they made. timeout_ms of a
    generate/stream call is a deadline for the whole call (None: no limit):
    when it passes, the call's requests are aborted and DeadlineExceeded
    names them, with what they made; cancelling the call's task aborts them
    too. Nothing of them reaches a later call. The constructor's timeout_ms
    is how long a call waits for its reply (RolloutClient)."""

    def __init__(self, addr: str = "tcp://127.0.0.1:5555", timeout_ms: int = 30000, **kwargs):
        from . import RolloutClient
        self._client = RolloutClient(addr, timeout_ms, **kwargs)
        self.timeout_ms = timeout_ms
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fp4rollout-client")
        self._lock = threading.Lock()
        self._routes: Dict[int, _Route] = {}
        self._backlog: Dict[int, list] = {}   # results of requests no call claimed yet (submit())
        self._expect: Dict[int, int] = {}     # samples of each submit()ted request not yet claimed
        self._work = threading.Event()        # a request went out: there is something to receive
        self._stop = False
        self._receiver = threading.Thread(target=self._receive, name="fp4rollout-receiver", daemon=True)
        self._receiver.start()

    # ---- the receiver ----

    def _receive(self) -> None:
        while not self._stop:
            self._work.clear()
            try:
                # deltas always: a call that wants them may claim its requests
                # while this wait runs
                item = self._client._wait(None, True, SLICE_MS, self._wants_delta)
            except ServerError as e:
                item = e
            except ClientError as e:   # the connection is lost: every waiting call hears it
                self._fail_all(e)
                self._work.wait(SLICE_MS / 1000.0)
                continue
            if item is None:
                if self._client.open_samples() == 0 and not self._stop:
                    self._work.wait(SLICE_MS / 1000.0)
                continue
            self._route(item.request_id, item)

    def _wants_delta(self, rid: int) -> bool:
        with self._lock:
            route = self._routes.get(rid)
        return route is not None and route.deltas

    def _route(self, rid: int, item) -> None:
        with self._lock:
            route = self._routes.get(rid)
            if route is None:
                if not isinstance(item, TokenDelta):
                    self._backlog.setdefault(rid, []).append(item)
                return
        if isinstance(item, TokenDelta) and not route.deltas:
            return
        route.loop.call_soon_threadsafe(route.queue.put_nowait, item)

    def _fail_all(self, e: Exception) -> None:
        with self._lock:
            routes = list(self._routes.values())
        for r in routes:
            r.loop.call_soon_threadsafe(r.queue.put_nowait, ClientError(str(e)))

    def _claim(self, ids: Sequence[int], deltas: bool) -> _Route:
        route = _Route(asyncio.get_running_loop(), deltas)
        with self._lock:
            for rid in ids:
                self._routes[rid] = route
                for item in self._backlog.pop(rid, []):
                    route.queue.put_nowait(item)
        return route

    def _release(self, ids: Sequence[int]) -> None:
        with self._lock:
            for rid in ids:
                self._routes.pop(rid, None)
                self._expect.pop(rid, None)

    # ---- calls ----

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @property
    def tokenizer(self):
        return self._client.tokenizer

    async def hello(self, name: str = "fp4rollout_client.py") -> dict:
        return await self._call(self._client.hello, name)

    async def stats(self) -> dict:
        return await self._call(self._client.stats)

    async def pause(self, mode: str = "wait", recompute: bool = False) -> dict:
        return await self._call(self._client.pause, mode, recompute)

    async def resume(self, recompute: bool = False) -> dict:
        return await self._call(self._client.resume, recompute)

    async def abort(self, request_ids=None) -> dict:
        return await self._call(self._client.abort, request_ids)

    async def update_weights(self, named_tensors, version: int, **kwargs) -> dict:
        return await self._call(self._client.update_weights, named_tensors, version, **kwargs)

    async def submit(self, prompt, **kwargs) -> int:
        """Sends one request (RolloutClient.submit); await results([id]) for its samples."""
        rid = await self._call(self._client.submit, prompt, **kwargs)
        with self._lock:
            self._expect[rid] = int(kwargs.get("n", 1))
        self._work.set()
        return rid

    async def results(self, request_ids: Sequence[int], timeout_ms: Optional[int] = None) -> List[SampleResult]:
        """Every sample of requests sent with submit(), each once (deadline as
        for generate)."""
        with self._lock:
            counts = {rid: self._expect.get(rid, 0) for rid in request_ids}
        return [s async for s in self._drain(list(request_ids), counts, False, timeout_ms, "results")]

    async def stream(self, prompts, timeout_ms: Optional[int] = None, **kwargs) -> AsyncIterator:
        """Submits like RolloutClient.generate and yields each sample of these
        requests as it finishes."""
        async for item in self._run(prompts, kwargs, timeout_ms, False, "stream"):
            yield item

    async def stream_tokens(self, prompts, timeout_ms: Optional[int] = None, **kwargs) -> AsyncIterator:
        """Submits like RolloutClient.generate and yields every TokenDelta of
        these requests as it arrives and every SampleResult as its sample
        finishes (RolloutClient.events)."""
        async for item in self._run(prompts, kwargs, timeout_ms, True, "stream_tokens"):
            yield item

    async def generate(self, prompts, timeout_ms: Optional[int] = None, **kwargs) -> List:
        """Every sample of the prompts, in the order they finished."""
        return [s async for s in self._run(prompts, kwargs, timeout_ms, False, "generate")]

    async def continue_sample(self, prompt, sample: SampleResult, timeout_ms: Optional[int] = None,
                              **kwargs) -> SampleResult:
        """RolloutClient.continue_sample: the rest of a partial sample, returned
        whole (stitched to `sample`)."""
        from . import continuation_options, stitch
        rest = await self.generate(prompt, timeout_ms=timeout_ms, **continuation_options(sample, kwargs))
        return stitch(sample, rest[0], self.tokenizer)

    async def _run(self, prompts, kwargs, timeout_ms, deltas: bool, what: str) -> AsyncIterator:
        c = self._client
        prompts = c._prompts(prompts, what)   # every prompt checked before any is sent
        ids = c._reserve(len(prompts))
        n = int(kwargs.get("n", 1))
        route = self._claim(ids, deltas)
        try:
            await self._call(c._send, prompts, {**_options(kwargs)}, ids[0], False)
        except BaseException:
            self._release(ids)
            raise
        self._work.set()
        async for item in self._drain(ids, {rid: n for rid in ids}, deltas, timeout_ms, what, route):
            yield item

    async def _drain(self, ids: List[int], counts: Dict[int, int], deltas: bool, timeout_ms: Optional[int],
                     what: str, route: Optional[_Route] = None) -> AsyncIterator:
        """Yields the calls' results until every sample of ids came; on its
        deadline, cancellation or an error, aborts what is open."""
        loop = asyncio.get_running_loop()
        route = route or self._claim(ids, deltas)
        until = None if timeout_ms is None else loop.time() + max(0, timeout_ms) / 1000.0
        finished = False
        try:
            while sum(counts.values()) > 0:
                left = None if until is None else max(0.0, until - loop.time())
                try:
                    item = await asyncio.wait_for(route.queue.get(), left)
                except asyncio.TimeoutError:
                    raise await self._expire(ids, counts, route, timeout_ms, what) from None
                if isinstance(item, BaseException):
                    if isinstance(item, ServerError) and item.request_id in counts:
                        counts[item.request_id] = 0
                    raise item
                if isinstance(item, SampleResult):
                    counts[item.request_id] -= 1
                yield item
            finished = True
        finally:
            if not finished:
                open_ids = [rid for rid, k in counts.items() if k > 0]
                if open_ids:   # nothing of them may reach a later call, nor keep running
                    self._pool.submit(self._abandon, open_ids)
            self._release(ids)

    async def _expire(self, ids, counts, route, timeout_ms, what) -> DeadlineExceeded:
        """The deadline passed: the open requests are aborted; what the abort
        ended comes with the error."""
        open_ids = [rid for rid, k in counts.items() if k > 0]
        try:
            await self.abort(open_ids)
        except ClientError:
            pass
        loop = asyncio.get_running_loop()
        end = loop.time() + ABORT_GRACE_S
        samples = []
        while sum(counts.values()) > 0 and loop.time() < end:
            try:
                item = await asyncio.wait_for(route.queue.get(), max(0.0, end - loop.time()))
            except asyncio.TimeoutError:
                break
            if isinstance(item, SampleResult):
                counts[item.request_id] -= 1
                samples.append(item)
            elif isinstance(item, ServerError) and item.request_id in counts:
                counts[item.request_id] = 0
        await self._call(self._client._discard, open_ids)
        for rid in open_ids:
            counts[rid] = 0
        return DeadlineExceeded(f"{what}: the deadline of {timeout_ms} ms passed with requests "
                                f"{', '.join(map(str, open_ids))} open; they were aborted on the server (what they "
                                f"made is in .samples)", open_ids, samples)

    def _abandon(self, ids: List[int]) -> None:
        """Aborts requests no call waits for any more and drops what comes of them."""
        try:
            if not self._client.lost():
                self._client.abort(ids)
        except ClientError:
            pass
        self._client._discard(ids)
        with self._lock:
            for rid in ids:
                self._backlog.pop(rid, None)

    async def close(self) -> None:
        self._stop = True
        self._work.set()
        await asyncio.get_running_loop().run_in_executor(None, self._receiver.join)
        await self._call(self._client.close)
        self._pool.shutdown(wait=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def _options(kwargs: dict) -> dict:
    """submit()'s keywords as RolloutClient._send takes them."""
    from . import _OPTIONS
    unknown = set(kwargs) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unknown keyword {sorted(unknown)[0]!r}")
    return {**_OPTIONS, **kwargs}
