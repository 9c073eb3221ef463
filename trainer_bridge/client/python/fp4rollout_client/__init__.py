"""Python client of the fp4rollout trainer bridge (docs/protocol.md).

A thin layer over the C client library through ctypes: no third-party
package is needed (numpy arrays and torch CPU tensors are accepted by
update_weights, but neither is required). Usage: trainer_bridge/client/python/README.md.
"""
import ctypes
import json
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _native
from . import text as _text
from .text import ByteTokenizer

__all__ = ["RolloutClient", "AsyncRolloutClient", "MetricsSubscriber", "SampleResult", "TokenDelta", "ServerError",
           "ClientError",
           "ByteTokenizer", "group_by_prompt", "mismatch_metrics", "keypair", "load_exported"]

_lib = None


def _native_lib():
    global _lib
    if _lib is None:
        _lib = _native.load()
    return _lib


class ClientError(Exception):
    """A failure on the client side (connection, timeout, bad argument)."""


class ConnectError(ClientError, ConnectionError):
    """No server answers at the endpoint (the message names it)."""


class ServerError(Exception):
    """An error message from the server: code (e.g. bad_checksum, invalid_request), message and request_id."""

    def __init__(self, code: str, message: str, request_id: Optional[int] = None):
        named = request_id is None or f"request {request_id}" in message
        super().__init__(f"{code}: {message}" + ("" if named else f" (request {request_id})"))
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class SampleResult:
    """One finished sample."""
    request_id: int
    group_id: int
    sample: int
    token_ids: List[int]
    logprobs: List[float]
    weight_versions: List[int]
    finish_reason: str
    n_prompt: int
    preemptions: int
    ttft_ms: Optional[float]
    total_ms: float
    # kl_mean, kl_max, top1_agreement, logprob_diff_mean, positions (None when not
    # monitored) and per_token_kl (a list when asked for, else None)
    divergence: Dict[str, object] = field(default_factory=dict)
    # the sampling seed that produced it (the request's, or the one the server drew
    # for an unseeded request): generate with it to replay the sample; None from a
    # server that does not report it
    seed: Optional[int] = None
    # the tokens as text, when the client has a tokenizer (None otherwise)
    text: Optional[str] = None
    # with logprobs=k: for every generated token, its k most likely tokens as
    # (token id, log-prob) pairs, best first (None when not asked)
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    # with prompt_logprobs=True, in the request's first sample: one entry per
    # prompt token, None for the first (nothing precedes it), else its log-prob
    # given the tokens before it
    prompt_logprobs: Optional[List[Optional[float]]] = None


@dataclass
class TokenDelta:
    """Tokens of one sample as the server streams them (docs/protocol.md,
    "tokens"): token_ids[i] is the sample's token start + i."""
    request_id: int
    sample: int
    start: int
    token_ids: List[int]
    logprobs: List[float]
    weight_versions: List[int]
    # the tokens as text, when the client has a tokenizer (None otherwise; a
    # multi-byte character split between deltas decodes with replacements)
    text: Optional[str] = None


def keypair() -> Tuple[str, str]:
    """A new CURVE key pair (public, secret), Z85 text."""
    pub, sec = ctypes.create_string_buffer(41), ctypes.create_string_buffer(41)
    if _native_lib().fr_client_keypair(pub, sec):
        raise ClientError(_native_lib().fr_client_error_text().decode())
    return pub.value.decode(), sec.value.decode()


def _int_array(values: Sequence[int]):
    arr = (ctypes.c_int * max(1, len(values)))(*[int(v) for v in values])
    return arr


def _curve_keys(server_public_key, public_key, secret_key):
    given = [k is not None for k in (server_public_key, public_key, secret_key)]
    if any(given) and not all(given):
        raise ClientError("CURVE needs server_public_key, public_key and secret_key together")
    if all(given):
        return _native.Curve(server_public_key.encode(), public_key.encode(), secret_key.encode())
    return None


class _Closes:
    """close() on leaving a with block and when collected."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class MetricsSubscriber(_Closes):
    """The server's metrics snapshots from its PUB socket (`metrics_pub_port`,
    docs/metrics.md): each one a dict with the keys of /metrics.json, for a
    trainer to log. A subscriber sees snapshots published after it joined
    (the server publishes about every 200 ms while it serves).
    """

    def __init__(self, addr: str = "tcp://127.0.0.1:5558", server_public_key: Optional[str] = None,
                 public_key: Optional[str] = None, secret_key: Optional[str] = None):
        lib = _native_lib()
        self._lib = lib
        self._s = ctypes.c_void_p()
        keys = _curve_keys(server_public_key, public_key, secret_key)
        if lib.fr_metrics_sub_new(addr.encode(), ctypes.byref(keys) if keys else None, ctypes.byref(self._s)):
            raise ClientError(lib.fr_client_error_text().decode())

    def next(self, timeout_ms: int = 1000) -> Optional[dict]:
        """The next snapshot, or None when none came within timeout_ms (-1: wait)."""
        if not self._s:
            raise ClientError("the subscriber is closed")
        out = ctypes.c_void_p()
        if self._lib.fr_metrics_sub_next(self._s, int(timeout_ms), ctypes.byref(out)):
            raise ClientError(self._lib.fr_client_error_text().decode())
        if not out.value:
            return None
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            self._lib.fr_client_free_string(out)

    def __iter__(self) -> Iterator[dict]:
        """Snapshots as they come, without end."""
        while True:
            yield self.next(-1)

    def close(self) -> None:
        if self._s:
            self._lib.fr_metrics_sub_destroy(ctypes.byref(self._s))
            self._s = ctypes.c_void_p()


class RolloutClient(_Closes):
    """A connection to `fp4rollout serve`.

    generate() submits prompts and yields each sample as it finishes;
    update_weights() sends new weights and returns once the server uses them;
    hello(), stats(), pause(), resume() and abort() return the server's reply
    as a dict. Not thread-safe: one thread per client.
    """

    def __init__(self, addr: str = "tcp://127.0.0.1:5555", timeout_ms: int = 30000,
                 server_public_key: Optional[str] = None, public_key: Optional[str] = None,
                 secret_key: Optional[str] = None, tokenizer=None):
        """tokenizer: any object with Hugging Face's encode/decode (prompts may
        then be text, and samples carry .text); "byte" for ByteTokenizer; None:
        a byte-level server's model gets ByteTokenizer when text is first used."""
        lib = _native_lib()
        self._lib = lib
        self.addr = addr
        self.tokenizer = ByteTokenizer() if tokenizer == "byte" else tokenizer
        self._tokenizer_checked = tokenizer is not None
        self._c = ctypes.c_void_p()
        keys = _curve_keys(server_public_key, public_key, secret_key)
        if lib.fr_client_new_curve(addr.encode(), ctypes.byref(keys) if keys else None, ctypes.byref(self._c)):
            raise ClientError(lib.fr_client_error_text().decode())
        lib.fr_client_set_timeout(self._c, int(timeout_ms))
        self.timeout_ms = timeout_ms
        self._next_id = 0   # request ids count from 0, as fp4rollout-client's --first-id does

    def close(self) -> None:
        if self._c:
            self._lib.fr_client_destroy(ctypes.byref(self._c))
            self._c = ctypes.c_void_p()

    # ---- errors and JSON replies ----

    def _raise(self):
        code, msg, rid = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_longlong(-1)
        text = self._lib.fr_client_error_text().decode()
        # The library's one error store holds the server's own code, message
        # and request id beside the text when the failure was its answer.
        if self._lib.fr_client_last_error(self._c, ctypes.byref(code), ctypes.byref(msg), ctypes.byref(rid)):
            raise ServerError(code.value.decode(), msg.value.decode(), rid.value if rid.value >= 0 else None)
        if "cannot reach a server" in text:
            raise ConnectError(text)
        raise ClientError(text)

    def _json(self, fn, *args) -> dict:
        out = ctypes.c_void_p()
        if fn(self._c, *args, ctypes.byref(out)):
            self._raise()
        try:
            return json.loads(ctypes.string_at(out.value).decode())
        finally:
            self._lib.fr_client_free_string(out)

    def hello(self, name: str = "fp4rollout_client.py") -> dict:
        return self._json(self._lib.fr_client_hello_json, name.encode())

    def stats(self) -> dict:
        return self._json(self._lib.fr_client_stats_json)

    def pause(self, mode: str = "wait") -> dict:
        return self._json(self._lib.fr_client_pause_json, _native.PAUSE_MODES[mode])

    def resume(self) -> dict:
        return self._json(self._lib.fr_client_resume_json)

    def abort(self, request_ids: Optional[Sequence[int]] = None) -> dict:
        """Ends the given requests (or every open one of this client); their samples
        still come out of generate()/results() with finish_reason "abort"."""
        ids = list(request_ids or [])
        arr = (ctypes.c_uint64 * max(1, len(ids)))(*ids)
        return self._json(self._lib.fr_client_abort_json, arr, len(ids))

    # ---- generation ----

    def submit(self, prompt_ids: Sequence[int], n: int = 1, temperature: Optional[float] = None,
               top_k: Optional[int] = None, top_p: Optional[float] = None, max_tokens: Optional[int] = None,
               stop_token_ids: Optional[Sequence[int]] = None, seed: Optional[int] = None,
               monitor: Optional[bool] = None, per_token_kl: bool = False,
               forced_tokens: Optional[Sequence[int]] = None, request_id: Optional[int] = None,
               group_id: Optional[int] = None, first_sample: int = 0, min_tokens: int = 0, logprobs: int = 0,
               prompt_logprobs: bool = False) -> int:
        """Sends one generate and returns its request id (results come from results()).
        prompt_ids: text (with a tokenizer), or token ids as a list, tuple, numpy
        or torch integer array. The samples are numbered first_sample ..
        first_sample + n - 1, and sample i draws from the seed's stream i: a
        sample s replays alone with seed=s.seed, first_sample=s.sample, n=1 and
        the same prompt and parameters (docs/sampling.md, "Seeds"). min_tokens:
        the stop tokens are barred until that many tokens were generated;
        logprobs=k (k <= 20): every token's k most likely tokens and their
        log-probs (SampleResult.top_logprobs); prompt_logprobs: the prompt
        tokens' log-probs in the first sample's result."""
        prompt_ids = self._ids(prompt_ids)
        rid = self._next_id if request_id is None else int(request_id)
        self._next_id = max(self._next_id, rid + 1)
        g = _native.Generate()
        prompt = _int_array(prompt_ids)
        g.request_id, g.prompt, g.n_prompt, g.n = rid, prompt, len(prompt_ids), int(n)
        g.first_sample = int(first_sample)
        g.min_tokens, g.logprobs, g.prompt_logprobs = int(min_tokens), int(logprobs), int(bool(prompt_logprobs))
        keep = [prompt]
        if group_id is not None:
            g.has_group_id, g.group_id = 1, int(group_id)
        if temperature is not None:
            g.has_temperature, g.temperature = 1, float(temperature)
        if top_k is not None:
            g.has_top_k, g.top_k = 1, int(top_k)
        if top_p is not None:
            g.has_top_p, g.top_p = 1, float(top_p)
        if max_tokens is not None:
            g.has_max_tokens, g.max_tokens = 1, int(max_tokens)
        if stop_token_ids is not None:
            stops = _int_array(stop_token_ids)
            keep.append(stops)
            g.has_stop_token_ids, g.stop_token_ids, g.n_stop_token_ids = 1, stops, len(stop_token_ids)
        if seed is not None:
            g.has_seed, g.seed = 1, int(seed)
        g.monitor_divergence = -1 if monitor is None else int(bool(monitor))
        g.per_token_kl = int(bool(per_token_kl))
        if forced_tokens is not None:
            forced = _int_array(forced_tokens)
            keep.append(forced)
            g.forced_tokens, g.n_forced_tokens = forced, len(forced_tokens)
        if self._lib.fr_client_generate(self._c, ctypes.byref(g)):
            self._raise()
        return rid

    def open_samples(self) -> int:
        return self._lib.fr_client_open_samples(self._c)

    def lost(self) -> bool:
        """True once the connection to the server ended with samples open
        (the server was killed or went silent for 3 s): results() then
        raises ClientError naming the requests whose samples will not end
        (docs/failures.md)."""
        return bool(self._lib.fr_client_lost(self._c))

    def resubmit(self) -> int:
        """Sends every request with samples open again, under its own
        request id, e.g. to a restarted server (a server that still has the
        request refuses the copy: request ids make this idempotent); what
        was streamed of their samples is dropped. Returns how many requests
        went out."""
        n = ctypes.c_int(0)
        if self._lib.fr_client_resubmit(self._c, ctypes.byref(n)):
            self._raise()
        return n.value

    def results(self, timeout_ms: Optional[int] = None) -> Iterator[SampleResult]:
        """Yields finished samples until none of this client's samples is open.
        A refused request raises ServerError (code, message, request_id)."""
        return self._drain(self._next_sample, timeout_ms, "no sample finished", "open")

    def events(self, timeout_ms: Optional[int] = None) -> Iterator[Union[TokenDelta, SampleResult]]:
        """Streams: yields every TokenDelta as it arrives and every SampleResult
        as its sample finishes (after its last delta), until none of this
        client's samples is open. A sample's deltas concatenated are its
        result's tokens. A refused request raises ServerError."""
        return self._drain(self._next_event, timeout_ms, "nothing arrived", "samples open")

    def _drain(self, fetch, timeout_ms: Optional[int], what: str, open_what: str) -> Iterator:
        """What fetch(wait) returns, until none of this client's samples is
        open; ClientError "<what> within N ms (K <open_what>)" when nothing
        comes in time."""
        wait = self.timeout_ms if timeout_ms is None else timeout_ms
        while self.open_samples() > 0:
            item = fetch(wait)
            if item is None:
                raise ClientError(f"{what} within {wait} ms ({self.open_samples()} {open_what})")
            yield item

    def _next_event(self, wait_ms: int) -> Optional[Union[TokenDelta, SampleResult]]:
        """The next delta or finished sample, or None when none came within wait_ms."""
        delta, ptr, got = _native.Delta(), ctypes.POINTER(_native.Sample)(), ctypes.c_int(0)
        if self._lib.fr_client_next_event(self._c, int(wait_ms), ctypes.byref(delta), ctypes.byref(ptr),
                                          ctypes.byref(got)):
            self._raise()
        if got.value == 0:
            return None
        if got.value == 1:   # the arrays live until the next call: copied now
            n = delta.n
            ids = [delta.token_ids[i] for i in range(n)]
            return TokenDelta(request_id=delta.request_id, sample=delta.sample, start=delta.start, token_ids=ids,
                              logprobs=[delta.logprobs[i] for i in range(n)],
                              weight_versions=[delta.weight_versions[i] for i in range(n)],
                              text=_text.decode(self.tokenizer, ids))
        try:
            s = _convert(ptr.contents)
        finally:
            self._lib.fr_client_sample_free(ctypes.byref(ptr))
        s.text = _text.decode(self.tokenizer, s.token_ids)
        return s

    def generate_stream(self, prompt_ids, timeout_ms: Optional[int] = None,
                        **kwargs) -> Iterator[Union[TokenDelta, SampleResult]]:
        """generate() with token-level streaming: submits the prompt(s) (request
        ids in order) with submit()'s keywords and yields what events() yields:
        each sample's tokens as they are drawn, then the sample."""
        prompts = [prompt_ids] if _text.is_single_prompt(prompt_ids) else list(prompt_ids)
        if not prompts:
            raise ClientError("generate_stream: no prompt given")
        prompts = [self._ids(p) for p in prompts]   # all checked before any is sent
        for p in prompts:
            self.submit(p, **kwargs)
        return self.events(timeout_ms)

    def _next_sample(self, wait_ms: int) -> Optional[SampleResult]:
        """The next finished sample, or None when none finished within wait_ms."""
        ptr, got = ctypes.POINTER(_native.Sample)(), ctypes.c_int(0)
        if self._lib.fr_client_next_sample(self._c, int(wait_ms), ctypes.byref(ptr), ctypes.byref(got)):
            self._raise()
        if not got.value:
            return None
        try:
            s = _convert(ptr.contents)
        finally:
            self._lib.fr_client_sample_free(ctypes.byref(ptr))
        s.text = _text.decode(self.tokenizer, s.token_ids)
        return s

    def generate(self, prompt_ids, n: int = 1, temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, max_tokens: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 monitor: Optional[bool] = None, per_token_kl: bool = False,
                 forced_tokens: Optional[Sequence[int]] = None, group_id: Optional[int] = None,
                 first_sample: int = 0, min_tokens: int = 0, logprobs: int = 0,
                 prompt_logprobs: bool = False) -> Iterator[SampleResult]:
        """Submits one prompt (text, or token ids as a list, tuple, numpy or torch
        integer array) or several (a list of such prompts, request ids in order)
        and yields every sample as it finishes, in the order they finish.
        monitor None lets the server's kl_sample_rate decide."""
        prompts = [prompt_ids] if _text.is_single_prompt(prompt_ids) else list(prompt_ids)
        if not prompts:
            raise ClientError("generate: no prompt given")
        prompts = [self._ids(p) for p in prompts]   # all checked before any is sent
        for p in prompts:
            self.submit(p, n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                        stop_token_ids=stop_token_ids, seed=seed, monitor=monitor, per_token_kl=per_token_kl,
                        forced_tokens=forced_tokens, group_id=group_id, first_sample=first_sample,
                        min_tokens=min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return self.results()

    def _ids(self, prompt) -> List[int]:
        if isinstance(prompt, str) and self.tokenizer is None and not self._tokenizer_checked:
            self._tokenizer_checked = True
            if _text.is_byte_vocabulary(self.hello()):
                self.tokenizer = ByteTokenizer(int(self.hello()["vocab_size"]))
        try:
            return _text.prompt_ids(prompt, self.tokenizer)
        except ValueError as e:
            raise ClientError(str(e)) from None

    # ---- weights ----

    def update_weights(self, named_tensors, version: int, bucket_bytes: Optional[int] = None,
                       partial: bool = False, _corrupt_bucket: int = -1) -> dict:
        """Sends new weights as `version` (greater than the server's) and returns
        the commit reply once the server uses them. named_tensors: a dict or a
        sequence of (name, tensor) with Hugging Face names; a tensor is a numpy
        array (float32, float16), a torch CPU tensor (float32, float16, bfloat16)
        or any C-contiguous buffer of float32 ('f') or float16 ('e'). The bytes
        are sent without a copy. partial=True sends only some of the model's
        tensors: the others keep their serving values (without it every weight
        of the model must be sent). A refusal raises ServerError with the
        server's code; the server then keeps its old weights."""
        items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        n = len(items)
        arr = (_native.Tensor * max(1, n))()
        keep = []
        for i, (name, t) in enumerate(items):
            dtype, shape, addr, owner = _tensor_view(t)
            shp = (ctypes.c_int64 * len(shape))(*shape)
            bname = name.encode()
            keep += [shp, bname, owner]
            arr[i] = _native.Tensor(bname, _native.DTYPES[dtype], len(shape), shp, addr)
        opts = _native.UpdateOpts(int(bucket_bytes or 0), int(_corrupt_bucket), int(bool(partial)))
        reply = _native.UpdateReply()
        if self._lib.fr_client_update_weights(self._c, arr, n, int(version), ctypes.byref(opts), ctypes.byref(reply)):
            self._raise()
        del keep
        return {"version": reply.version, "bytes": reply.bytes, "weight_version": reply.weight_version}

    def init_weight_group(self, device=None) -> None:
        """Makes an NCCL group with the server for weight updates
        (docs/protocol.md, "Weights over NCCL"), this process as rank 0 on CUDA
        device `device` (an int, a torch.device or "cuda:N"; None: torch's
        current device). Returns once every rank of the server joined (a
        tensor-parallel or several-engine server joins with all its ranks:
        weight_group_size()). The server must serve on the cuda backend;
        otherwise ServerError with code nccl_unavailable. A library built
        without CUDA raises ClientError."""
        if device is None:
            import torch  # only for the default device
            device = torch.cuda.current_device()
        index = device if isinstance(device, int) else getattr(device, "index", None)
        if index is None and isinstance(device, str):
            index = int(device.split(":")[1]) if ":" in device else 0
        if index is None:
            index = 0
        if self._lib.fr_client_nccl_group_init(self._c, int(index)):
            self._raise()

    def weight_group_size(self) -> int:
        """Members of the NCCL weight group: this client and every rank of the
        server (0 when there is no group)."""
        return int(self._lib.fr_client_nccl_group_size(self._c))

    def close_weight_group(self) -> None:
        """Ends the NCCL weight group on both sides (nothing when there is none)."""
        if self._lib.fr_client_nccl_group_close(self._c):
            self._raise()

    def update_weights_nccl(self, named_tensors, version: int, bucket_bytes: Optional[int] = None,
                            partial: bool = False, _corrupt_bucket: int = -1) -> dict:
        """update_weights over the NCCL group (init_weight_group first): the
        tensors are torch CUDA tensors on the group's device (bfloat16,
        float16 or float32, contiguous), read in place on the current CUDA
        stream after the work already queued on it: nothing is copied to the
        host. partial as for update_weights. Returns the commit reply once the server uses the new weights;
        a refusal raises ServerError with the server's code, and any failure
        after the begin also ends the group (init a new one)."""
        import torch  # the tensors are torch's
        items = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        n = len(items)
        arr = (_native.Tensor * max(1, n))()
        keep = []
        for i, (name, t) in enumerate(items):
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                raise ClientError(f"update_weights_nccl: {name} must be a torch CUDA tensor")
            t = t.detach()
            if not t.is_contiguous():
                raise ClientError(f"update_weights_nccl: {name} is not contiguous (it would need a copy)")
            kind = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}.get(t.dtype)
            if kind is None:
                raise ClientError(f"update_weights_nccl: {name}: unsupported dtype {t.dtype}")
            shape = list(t.shape) or [1]
            shp = (ctypes.c_int64 * len(shape))(*shape)
            bname = name.encode()
            keep += [shp, bname, t]
            arr[i] = _native.Tensor(bname, _native.DTYPES[kind], len(shape), shp, t.data_ptr())
        stream = torch.cuda.current_stream().cuda_stream
        opts = _native.UpdateOpts(int(bucket_bytes or 0), int(_corrupt_bucket), int(bool(partial)))
        reply = _native.UpdateReply()
        if self._lib.fr_client_update_weights_nccl(self._c, arr, n, int(version), ctypes.c_void_p(stream),
                                                   ctypes.byref(opts), ctypes.byref(reply)):
            self._raise()
        del keep
        return {"version": reply.version, "bytes": reply.bytes, "weight_version": reply.weight_version}


def _tensor_view(t):
    """(dtype, shape, address, owner) of a tensor without copying it when it is
    C-contiguous; owner keeps the memory alive."""
    if hasattr(t, "detach") and hasattr(t, "dtype") and str(t.dtype).startswith("torch."):   # a torch tensor
        import torch  # only when one was passed
        t = t.detach()
        if t.device.type != "cpu":
            raise ClientError("update_weights takes CPU tensors")
        t = t.contiguous()
        kind = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}.get(t.dtype)
        if kind is None:
            raise ClientError(f"unsupported tensor dtype {t.dtype}")
        return kind, list(t.shape) or [1], t.data_ptr(), t
    if type(t).__module__ == "numpy" and hasattr(t, "ctypes"):
        import numpy as np
        kind = {np.dtype("float32"): "f32", np.dtype("float16"): "f16"}.get(t.dtype)
        if kind is None:
            raise ClientError(f"unsupported array dtype {t.dtype} (float32 or float16; bf16 via torch)")
        t = np.ascontiguousarray(t)
        return kind, list(t.shape) or [1], t.ctypes.data, t
    mv = memoryview(t)
    kind = {"f": "f32", "e": "f16"}.get(mv.format)
    if kind is None or not mv.c_contiguous:
        raise ClientError(f"unsupported buffer (format {mv.format!r}; want a C-contiguous 'f' or 'e' buffer)")
    if mv.readonly:
        mv = memoryview(bytearray(mv.tobytes())).cast(mv.format, mv.shape)
    holder = (ctypes.c_char * mv.nbytes).from_buffer(mv.cast("B"))
    return kind, list(mv.shape) or [1], ctypes.addressof(holder), (mv, holder)


def _convert(s) -> SampleResult:
    n = s.n_tokens
    d = s.divergence
    div = {"kl_mean": None, "kl_max": None, "top1_agreement": None, "logprob_diff_mean": None, "positions": None,
           "per_token_kl": None}
    if d.has_values:
        div.update(kl_mean=d.kl_mean, kl_max=d.kl_max, top1_agreement=d.top1_agreement,
                   logprob_diff_mean=d.logprob_diff_mean, positions=d.positions)
        if d.kl:
            div["per_token_kl"] = [d.kl[i] for i in range(d.n_kl)]
    return SampleResult(request_id=s.request_id, group_id=s.group_id, sample=s.sample,
                        token_ids=[s.token_ids[i] for i in range(n)], logprobs=[s.logprobs[i] for i in range(n)],
                        weight_versions=[s.weight_versions[i] for i in range(n)],
                        finish_reason=s.finish_reason.decode(), n_prompt=s.n_prompt, preemptions=s.preemptions,
                        ttft_ms=s.ttft_ms if s.has_ttft else None, total_ms=s.total_ms, divergence=div,
                        seed=s.seed if s.has_seed else None, top_logprobs=_top(s),
                        prompt_logprobs=[None] + [s.prompt_logprobs[i] for i in range(s.n_prompt_logprobs)]
                        if s.prompt_logprobs else None)


def _top(s) -> Optional[List[List[Tuple[int, float]]]]:
    k = s.top_k
    if k <= 0:
        return None
    return [[(s.top_token_ids[i * k + j], s.top_logprobs[i * k + j]) for j in range(k)] for i in range(s.n_tokens)]


def load_exported(bin_path: str, index_path: str):
    """The tensors `fp4rollout-client push-weights --export BIN` wrote (float32,
    in order; the index is one JSON line {name, shape} per tensor) as a dict of
    numpy arrays, ready for update_weights. Needs numpy."""
    import json
    import numpy as np
    flat = np.fromfile(bin_path, dtype=np.float32)
    out, off = {}, 0
    for line in open(index_path):
        t = json.loads(line)
        n = 1
        for d in t["shape"]:
            n *= int(d)
        if off + n > flat.size:
            raise ClientError(f"{bin_path}: {t['name']} runs past the {flat.size} floats of the file")
        out[t["name"]] = flat[off:off + n].reshape(t["shape"])
        off += n
    if off != flat.size:
        raise ClientError(f"{bin_path}: {flat.size - off} floats are left over after the index's tensors")
    return out


# ---- DAPO / GRPO helpers ----

def group_by_prompt(samples: Iterable[SampleResult]) -> Dict[int, List[SampleResult]]:
    """The samples by group id (the request id unless the request gave a group),
    each group ordered by (request_id, sample): one GRPO/DAPO group per prompt."""
    groups: Dict[int, List[SampleResult]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    for g in groups.values():
        g.sort(key=lambda s: (s.request_id, s.sample))
    return groups


def _flatten(x) -> List[float]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    out: List[float] = []
    for v in x:
        if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
            out.extend(_flatten(v))
        else:
            out.append(float(v))
    return out


def mismatch_metrics(rollout_logprobs, trainer_logprobs, mask=None) -> Dict[str, float]:
    """Rollout-vs-trainer mismatch over tokens, as verl and prime-rl name it.

    rollout_logprobs: the log-probs the rollout engine reported (SampleResult.logprobs),
    trainer_logprobs: the trainer's recomputation for the same tokens, same shape
    (flat, or one list per sample); mask: 1 for tokens to count (default all).
    With p_r = exp(rollout_logprob), p_t = exp(trainer_logprob) per token:
      rollout_probs_diff_mean = mean |p_r - p_t|
      rollout_probs_diff_max  = max  |p_r - p_t|
      rollout_probs_diff_std  = population standard deviation of |p_r - p_t|
      mismatch_kl = mean of exp(r) - 1 - r, r = trainer_logprob - rollout_logprob
                    (the k3 estimator of KL(rollout || trainer): >= 0, 0 when equal)
    """
    a, b = _flatten(rollout_logprobs), _flatten(trainer_logprobs)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} rollout log-probs but {len(b)} trainer log-probs")
    m = _flatten(mask) if mask is not None else [1.0] * len(a)
    if len(m) != len(a):
        raise ValueError(f"mask has {len(m)} entries for {len(a)} tokens")
    diffs, k3 = [], []
    for lr, lt, w in zip(a, b, m):
        if not w:
            continue
        diffs.append(abs(math.exp(lr) - math.exp(lt)))
        r = lt - lr
        k3.append(math.expm1(r) - r)
    if not diffs:
        raise ValueError("no tokens to measure")
    mean = sum(diffs) / len(diffs)
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / len(diffs))
    return {"rollout_probs_diff_mean": mean, "rollout_probs_diff_max": max(diffs), "rollout_probs_diff_std": std,
            "mismatch_kl": sum(k3) / len(k3), "tokens": float(len(diffs))}


from .aio import AsyncRolloutClient  # noqa: E402  (it builds on RolloutClient)
