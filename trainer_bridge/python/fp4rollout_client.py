"""Python client of the fp4rollout trainer bridge (protocol version 1).

Speaks the protocol of docs/protocol.md over a ZeroMQ DEALER socket with
msgpack frames. Needs only pyzmq and msgpack (Debian: python3-zmq,
python3-msgpack). Usage is in trainer_bridge/python/README.md.
"""

import collections
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import msgpack
import zmq

PROTOCOL_VERSION = 1
CLIENT_TYPES = ("hello", "generate", "abort", "pause", "resume", "stats")
SERVER_TYPES = ("hello_reply", "tokens", "done", "abort_reply", "pause_reply",
                "resume_reply", "stats_reply", "error")


class ProtocolError(Exception):
    """The server sent something this client cannot read."""


class ServerError(Exception):
    """An error message from the server: code, message and request_id (or None)."""

    def __init__(self, code: str, message: str, request_id: Optional[int] = None):
        super().__init__(f"{code}: {message}" + (f" (request {request_id})" if request_id is not None else ""))
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class Trajectory:
    """One finished sample, assembled from its token deltas and its done."""
    request_id: int
    sample: int
    group_id: int = 0
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    weight_versions: List[int] = field(default_factory=list)
    finish_reason: str = ""
    n_prompt: int = 0
    preemptions: int = 0
    ttft_ms: Optional[float] = None
    total_ms: float = 0.0
    divergence: Dict[str, Optional[float]] = field(default_factory=dict)


class Client:
    """A connection to `fp4rollout serve`.

    Results arrive asynchronously: generate() returns at once; poll() hands
    back the next raw message (tokens, done or error), and results() yields
    each sample's Trajectory when its done arrives. hello(), stats(),
    pause(), resume() and abort() wait for their reply and keep whatever
    else arrives meanwhile for poll()/results(). Not thread-safe.
    """

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", timeout_ms: int = 30000,
                 context: Optional[zmq.Context] = None):
        self.timeout_ms = timeout_ms
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(endpoint)
        self._kept = collections.deque()
        self._open: Dict[int, int] = {}            # request_id -> samples without done
        self._partial: Dict[Tuple[int, int], Trajectory] = {}

    def close(self) -> None:
        self._sock.close()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- sending -----------------------------------------------------------

    def _send(self, msg: dict) -> None:
        msg = {"type": msg.pop("type"), "v": PROTOCOL_VERSION, **msg}
        self._sock.send(msgpack.packb(msg, use_bin_type=True))

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Sends frames as they are (for testing a server's validation)."""
        self._sock.send_multipart(list(frames))

    def generate(self, request_id: int, prompt: Sequence[int], n: int = 1, *,
                 temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, max_tokens: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 group_id: Optional[int] = None, monitor_divergence: bool = False) -> None:
        """Sends a generate request. Parameters left as None take the
        server's defaults; stop_token_ids=[] means no stop tokens."""
        if request_id in self._open:
            raise ValueError(f"request_id {request_id} is still open")
        msg = {"type": "generate", "request_id": int(request_id),
               "prompt": [int(t) for t in prompt], "n": int(n),
               "monitor_divergence": bool(monitor_divergence)}
        for key, value, conv in (("temperature", temperature, float), ("top_k", top_k, int),
                                 ("top_p", top_p, float), ("max_tokens", max_tokens, int),
                                 ("seed", seed, int), ("group_id", group_id, int)):
            if value is not None:
                msg[key] = conv(value)
        if stop_token_ids is not None:
            msg["stop_token_ids"] = [int(t) for t in stop_token_ids]
        self._send(msg)
        self._open[int(request_id)] = int(n)

    @property
    def open_samples(self) -> int:
        """Samples sent whose done has not arrived (refused requests excluded)."""
        return sum(self._open.values())

    # ---- receiving ---------------------------------------------------------

    def _recv(self, timeout_ms: Optional[int]) -> Optional[dict]:
        if timeout_ms is not None and timeout_ms >= 0:
            if not self._sock.poll(timeout_ms, zmq.POLLIN):
                return None
        frames = self._sock.recv_multipart()
        if len(frames) != 1:
            raise ProtocolError(f"the server sent {len(frames)} frames")
        try:
            msg = msgpack.unpackb(frames[0], raw=False)
        except Exception as e:  # msgpack raises several types
            raise ProtocolError(f"frame 0 is not msgpack: {e}") from None
        if not isinstance(msg, dict) or msg.get("type") not in SERVER_TYPES:
            raise ProtocolError(f"unexpected message: {msg!r:.200}")
        if msg.get("v") != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {msg.get('v')!r}, this client speaks {PROTOCOL_VERSION}")
        self._track(msg)
        return msg

    def _track(self, msg: dict) -> None:
        t = msg["type"]
        if t == "done":
            rid = msg["request_id"]
            if rid in self._open:
                self._open[rid] -= 1
                if self._open[rid] <= 0:
                    del self._open[rid]
        elif t == "error" and msg.get("request_id") is not None and msg["code"] != "duplicate_request_id":
            self._open.pop(msg["request_id"], None)

    def poll(self, timeout_ms: Optional[int] = None) -> Optional[dict]:
        """The next tokens, done or error message as a dict, or None when
        nothing came within timeout_ms (None: self.timeout_ms; -1: forever)."""
        if self._kept:
            return self._kept.popleft()
        return self._recv(self.timeout_ms if timeout_ms is None else timeout_ms)

    def results(self, timeout_ms: Optional[int] = None, raise_errors: bool = True,
                on_tokens: Optional[Callable[[dict], None]] = None) -> Iterator[Trajectory]:
        """Yields each sample's Trajectory when its done arrives, until no
        sample is open. Checks that deltas are contiguous and that the
        tokens streamed equal the done's count. on_tokens, when given, sees
        every tokens message as it arrives (it may call generate() or the
        synchronous calls). An error about a request raises ServerError
        (raise_errors) or is skipped. TimeoutError when nothing arrives for
        timeout_ms."""
        while self.open_samples > 0 or self._kept:
            msg = self.poll(timeout_ms)
            if msg is None:
                raise TimeoutError(f"nothing arrived with {self.open_samples} samples open")
            t = msg["type"]
            if t == "tokens":
                key = (msg["request_id"], msg["sample"])
                tr = self._partial.setdefault(key, Trajectory(*key))
                if msg["start"] != len(tr.token_ids):
                    raise ProtocolError(f"request {key[0]} sample {key[1]}: delta starts at {msg['start']} "
                                        f"after {len(tr.token_ids)} tokens")
                tr.token_ids += msg["token_ids"]
                tr.logprobs += msg["logprobs"]
                tr.weight_versions += msg["weight_versions"]
                if on_tokens:
                    on_tokens(msg)
            elif t == "done":
                key = (msg["request_id"], msg["sample"])
                tr = self._partial.pop(key, None) or Trajectory(*key)
                if msg["n_tokens"] != len(tr.token_ids):
                    raise ProtocolError(f"request {key[0]} sample {key[1]}: {len(tr.token_ids)} tokens "
                                        f"streamed, done says {msg['n_tokens']}")
                tr.group_id = msg["group_id"]
                tr.finish_reason = msg["finish_reason"]
                tr.n_prompt = msg["n_prompt"]
                tr.preemptions = msg["preemptions"]
                tr.ttft_ms = msg["ttft_ms"]
                tr.total_ms = msg["total_ms"]
                tr.divergence = msg["divergence"]
                yield tr
            elif t == "error":
                if raise_errors:
                    raise ServerError(msg["code"], msg["message"], msg.get("request_id"))

    def _call(self, msg: dict, want: str) -> dict:
        sent_type = msg["type"]
        self._send(msg)
        deadline = None if self.timeout_ms < 0 else time.monotonic() + self.timeout_ms / 1000
        while True:
            left = -1 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if deadline is not None and left <= 0:
                raise TimeoutError(f"no {want} within {self.timeout_ms} ms")
            reply = self._recv(left)
            if reply is None:
                continue
            if reply["type"] == want:
                return reply
            if reply["type"] == "error" and reply.get("request_id") is None:
                raise ServerError(reply["code"], f"{sent_type}: {reply['message']}")
            self._kept.append(reply)

    # ---- synchronous calls -------------------------------------------------

    def hello(self, name: Optional[str] = None) -> dict:
        msg = {"type": "hello"}
        if name:
            msg["client"] = name
        return self._call(msg, "hello_reply")

    def stats(self) -> dict:
        return self._call({"type": "stats"}, "stats_reply")

    def pause(self, mode: str = "abort") -> dict:
        """mode "abort": samples in flight end now (reason abort); "wait":
        returns once they have finished. New generates wait for resume()."""
        if mode not in ("abort", "wait"):
            raise ValueError("mode must be 'abort' or 'wait'")
        return self._call({"type": "pause", "mode": mode}, "pause_reply")

    def resume(self) -> dict:
        return self._call({"type": "resume"}, "resume_reply")

    def abort(self, request_ids: Optional[Sequence[int]] = None) -> dict:
        """Aborts the given requests of this client (None: all of them)."""
        if request_ids is None:
            msg = {"type": "abort", "all": True}
        else:
            msg = {"type": "abort", "request_ids": [int(i) for i in request_ids]}
        return self._call(msg, "abort_reply")
