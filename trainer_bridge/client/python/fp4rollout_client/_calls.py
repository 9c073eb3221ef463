"""The results of one call of the blocking client: an iterator over its own
requests (or over every request no call owns), with a deadline for the
whole call."""
import time
from typing import List, Optional

from ._types import ClientError, DeadlineExceeded, SampleResult, ServerError

# Waits are cut into slices this long, so that a signal (Ctrl-C) reaches
# the caller in time; a result ends a slice at once.
SLICE_MS = 500


class Drain:
    """What RolloutClient.results(), events(), generate() and
    generate_stream() return: an iterator over the call's samples (and token
    deltas when asked), until none of its requests has a sample open.

    ids: the call's own requests (sent owned: no other reader sees them), or
    None for every request that no call owns. timeout_ms: a deadline for the
    whole call (None: none). When it passes, the open requests are aborted on
    the server and DeadlineExceeded is raised, naming them and holding what
    they made; nothing of them reaches a later call. A call over its own
    requests that ends early (an error, or the iterator dropped before its
    end) aborts what is still open, the same way.
    """

    def __init__(self, client, ids: Optional[List[int]], deltas: bool, timeout_ms: Optional[int], what: str):
        self._c = client
        self._ids = ids
        self._deltas = deltas
        self._what = what
        self._timeout_ms = timeout_ms
        self._until = None if timeout_ms is None else time.monotonic() + max(0, timeout_ms) / 1000.0
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            return self._next()
        except StopIteration:
            self._done = True
            raise
        except ServerError:
            if self._ids is not None:   # the call's other requests end with it
                self.close()
            raise
        except BaseException:
            self.close()
            raise

    def _next(self):
        while True:
            left = None if self._until is None else int((self._until - time.monotonic()) * 1000)
            if left is not None and left <= 0 and self._c._open_of(self._ids) > 0:
                self._expire()
            wait = SLICE_MS if left is None else max(0, min(SLICE_MS, left))
            item = self._c._wait(self._ids, self._deltas, wait)
            if item is not None:
                return item
            if self._c._open_of(self._ids) == 0:
                raise StopIteration

    def _expire(self):
        """The deadline passed: abort, collect what the abort ended, raise."""
        ids = self._ids if self._ids is not None else self._c._open_requests()
        ids = [i for i in ids if self._c._open_of([i]) > 0]
        samples = self._abandon(ids)
        self._done = True
        raise DeadlineExceeded(f"{self._what}: the deadline of {self._timeout_ms} ms passed with requests "
                               f"{', '.join(map(str, ids))} open; they were aborted on the server (what they made "
                               f"is in .samples)", ids, samples)

    def _abandon(self, ids: List[int]) -> List[SampleResult]:
        """Aborts ids on the server (unless the connection is lost), reads the
        samples the abort ended (their dones came before its reply), and
        gives the requests up on this side."""
        samples: List[SampleResult] = []
        if not ids:
            return samples
        try:
            if not self._c.lost():
                self._c.abort(ids)
            while True:
                try:
                    item = self._c._wait(ids, False, 0)
                except ServerError:
                    continue   # a refused request: nothing of it to keep
                if item is None:
                    break
                samples.append(item)
        except ClientError:
            pass   # the server is gone or does not answer: nothing more will come
        finally:
            self._c._discard(ids)
        return samples

    def close(self) -> None:
        """Ends the call: its own requests still open are aborted (nothing of
        them reaches a later call); a call over every request leaves them
        for the next."""
        if self._done:
            return
        self._done = True
        if self._ids is not None and self._c._alive():
            self._abandon([i for i in self._ids if self._c._open_of([i]) > 0])

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
