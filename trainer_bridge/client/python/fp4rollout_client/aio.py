"""The asyncio face of RolloutClient, for trainers built on an event loop.

Every call runs the blocking client on one worker thread that this object
owns (the C client is not thread-safe, so all its calls stay on that
thread), so awaiting never blocks the loop. Waits for samples are cut into
short slices, so cancelling a task that awaits results takes effect within
one slice.
"""
import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, List, Optional

SLICE_MS = 100


class AsyncRolloutClient:
    """RolloutClient's methods as coroutines: hello, stats, pause, resume, abort,
    submit, update_weights; generate() returns every sample, stream() yields
    them as they finish. Use `async with AsyncRolloutClient(addr) as c:`."""

    def __init__(self, addr: str = "tcp://127.0.0.1:5555", timeout_ms: int = 30000, **kwargs):
        from . import RolloutClient
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4rollout-client")
        self.timeout_ms = timeout_ms
        self._client = self._pool.submit(RolloutClient, addr, timeout_ms, **kwargs).result()

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

    async def pause(self, mode: str = "wait") -> dict:
        return await self._call(self._client.pause, mode)

    async def resume(self) -> dict:
        return await self._call(self._client.resume)

    async def abort(self, request_ids=None) -> dict:
        return await self._call(self._client.abort, request_ids)

    async def update_weights(self, named_tensors, version: int, **kwargs) -> dict:
        return await self._call(self._client.update_weights, named_tensors, version, **kwargs)

    async def submit(self, prompt, **kwargs) -> int:
        return await self._call(self._client.submit, prompt, **kwargs)

    async def stream(self, prompts, timeout_ms: Optional[int] = None, **kwargs) -> AsyncIterator:
        """Submits like RolloutClient.generate and yields each sample as it finishes."""
        async for sample in self._drain(prompts, kwargs, timeout_ms, self._client._next_sample,
                                        "no sample finished"):
            yield sample

    async def stream_tokens(self, prompts, timeout_ms: Optional[int] = None, **kwargs) -> AsyncIterator:
        """Submits like RolloutClient.generate and yields every TokenDelta as it
        arrives and every SampleResult as its sample finishes
        (RolloutClient.events)."""
        async for event in self._drain(prompts, kwargs, timeout_ms, self._client._next_event, "nothing arrived"):
            yield event

    async def _drain(self, prompts, kwargs, timeout_ms, fetch, what) -> AsyncIterator:
        """Submits, then yields what fetch(SLICE_MS) returns until no sample is
        open; ClientError "<what> within N ms" when nothing comes in time."""
        await self._call(self._submit_all, prompts, kwargs)
        wait = self.timeout_ms if timeout_ms is None else timeout_ms
        from . import ClientError
        while await self._call(self._client.open_samples) > 0:
            deadline = time.monotonic() + wait / 1000.0
            item = None
            while item is None:
                item = await self._call(fetch, SLICE_MS)
                if item is None and time.monotonic() > deadline:
                    raise ClientError(f"{what} within {wait} ms")
            yield item

    async def generate(self, prompts, **kwargs) -> List:
        """Every sample of the prompts, in the order they finished."""
        return [s async for s in self.stream(prompts, **kwargs)]

    def _submit_all(self, prompts, kwargs):
        # generate() validates every prompt before sending any; its iterator is
        # dropped unread here: stream() collects the results itself.
        self._client.generate(prompts, **kwargs)

    async def close(self) -> None:
        await self._call(self._client.close)
        self._pool.shutdown(wait=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
