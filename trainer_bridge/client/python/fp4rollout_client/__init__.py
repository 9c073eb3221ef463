"""Python client of the fp4rollout trainer bridge (docs/protocol.md).

A thin layer over the C client library through ctypes: no third-party
package is needed (numpy arrays and torch CPU tensors are accepted by
update_weights, but neither is required). Usage: trainer_bridge/client/python/README.md.
"""
import ctypes
import json
import math
import threading
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _native
from . import text as _text
from ._calls import Drain as _Drain
from ._types import (ClientError, ConnectError, DeadlineExceeded, SampleResult, ServerError, TokenDelta,
                     from_event as _from_event, id_array as _id_array, stitch)
from .text import ByteTokenizer

__all__ = ["RolloutClient", "AsyncRolloutClient", "MetricsSubscriber", "SampleResult", "TokenDelta", "ServerError",
           "ClientError", "ConnectError", "DeadlineExceeded",
           "ByteTokenizer", "group_by_prompt", "mismatch_metrics", "keypair", "load_exported", "stitch"]

_lib = None


def _native_lib():
    global _lib
    if _lib is None:
        _lib = _native.load()
    return _lib

def keypair() -> Tuple[str, str]:
    """A new CURVE key pair (public, secret), Z85 text."""
    pub, sec = ctypes.create_string_buffer(41), ctypes.create_string_buffer(41)
    if _native_lib().fr_client_keypair(pub, sec):
        raise ClientError(_native_lib().fr_client_error_text().decode())
    return pub.value.decode(), sec.value.decode()


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


# A generate's options and their defaults (submit()'s keywords).
_OPTIONS = dict(n=1, temperature=None, top_k=None, top_p=None, max_tokens=None, stop_token_ids=None, seed=None,
                monitor=None, per_token_kl=False, forced_tokens=None, group_id=None, first_sample=0, min_tokens=0,
                logprobs=0, prompt_logprobs=False, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=None, continue_tokens=None, stop=None, include_stop_str_in_output=False,
                add_special_tokens=None, return_text=None, return_routed_experts=False, skip_special_tokens=True)


class RolloutClient(_Closes):
    """A connection to `fp4rollout serve`.

    generate() submits prompts and yields each of their samples as it
    finishes; submit() sends one request whose samples results() yields;
    update_weights() sends new weights and returns once the server uses them;
    hello(), stats(), pause(), resume() and abort() return the server's reply
    as a dict.

    Thread-safe: several threads may use one client at once. Each generate()
    call owns its requests and yields exactly their samples, each once,
    whatever other threads run; results() and events() yield the samples of
    the requests sent with submit().

    Time limits: timeout_ms is how long a call waits for its reply (hello,
    stats, abort, resume, a pause in abort mode, updates); a pause in wait
    mode waits as long as the samples in flight. Waits for samples have no
    limit by default (a sample of 32K tokens takes what it takes; a lost
    server is noticed within 3 s); their timeout_ms is a deadline for the
    whole call, after which its requests are aborted (DeadlineExceeded).
    """

    def __init__(self, addr: str = "tcp://127.0.0.1:5555", timeout_ms: int = 30000,
                 server_public_key: Optional[str] = None, public_key: Optional[str] = None,
                 secret_key: Optional[str] = None, tokenizer=None):
        """tokenizer: None (default): the server's tokenizer (hello()["tokenizer"])
        when text is first used: text prompts go as text, samples and deltas
        carry the server's text (a server without one: ByteTokenizer for a
        byte-level model); "server": the server's, without asking; any object
        with Hugging Face's encode/decode: text is encoded and decoded here
        (stop strings still need the server's); "byte": ByteTokenizer."""
        lib = _native_lib()
        self._lib = lib
        self.addr = addr
        self.tokenizer = ByteTokenizer() if tokenizer == "byte" else None if tokenizer == "server" else tokenizer
        self._server_text = True if tokenizer == "server" else None   # None: not asked yet
        self._tokenizer_checked = tokenizer is not None
        self._c = ctypes.c_void_p()
        keys = _curve_keys(server_public_key, public_key, secret_key)
        if lib.fr_client_new_curve(addr.encode(), ctypes.byref(keys) if keys else None, ctypes.byref(self._c)):
            raise ClientError(lib.fr_client_error_text().decode())
        lib.fr_client_set_timeout(self._c, int(timeout_ms))
        self.timeout_ms = timeout_ms
        self._lock = threading.Lock()
        self._next_id = 0   # request ids count from 0, as fp4rollout-client's --first-id does

    def close(self) -> None:
        if self._c:
            self._lib.fr_client_destroy(ctypes.byref(self._c))
            self._c = ctypes.c_void_p()

    def _alive(self) -> bool:
        return bool(self._c)

    # ---- errors and JSON replies ----

    def _raise(self):
        code, msg, rid = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_longlong(-1)
        text = self._lib.fr_client_error_text().decode(errors="replace")
        # The library's one error store is per thread: it holds the server's
        # own code, message and request id beside the text when the calling
        # thread's failure was the server's answer.
        if self._lib.fr_client_last_error(self._c, ctypes.byref(code), ctypes.byref(msg), ctypes.byref(rid)):
            raise ServerError(code.value.decode(errors="replace"), msg.value.decode(errors="replace"),
                              rid.value if rid.value >= 0 else None)
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
        reply = self._json(self._lib.fr_client_hello_json, name.encode())
        if self._server_text is None:   # what text does from now on (return_text's default)
            self._server_text = bool(reply.get("tokenizer"))
        return reply

    def stats(self) -> dict:
        return self._json(self._lib.fr_client_stats_json)

    def pause(self, mode: str = "wait", recompute: bool = False) -> dict:
        """mode "abort": every sample in the engine ends now with finish_reason
        "abort" and what it made so far (tokens, log-probs, weight versions),
        each delivered once to the call that waits for it (generate(),
        results()); "wait": returns once the samples in flight finished,
        starting nothing new; "keep": freezes the samples in flight where
        they are (tokens and KV cache kept) and returns at once: weights
        committed meanwhile draw their next tokens after resume() (each
        token's weight_versions entry says which weights drew it). keep with
        recompute=True drops their KV cache now (its memory is free during
        the update) and recomputes it at resume with the weights serving
        then. New requests are held until resume() (docs/protocol.md,
        "pause")."""
        if mode not in _native.PAUSE_MODES:
            raise ClientError(f"pause: mode must be one of {', '.join(_native.PAUSE_MODES)}, got {mode!r}")
        return self._json(self._lib.fr_client_pause_ex_json, _native.PAUSE_MODES[mode], int(bool(recompute)))

    def resume(self, recompute: bool = False) -> dict:
        """Ends the pause: held requests start, frozen samples go on.
        recompute=True (after a keep pause): the frozen samples' KV cache is
        recomputed with the weights serving now, so their next tokens are
        exactly those of the new weights; without it they go on over the KV
        cache the old weights computed (as SGLang's and vLLM's pause in
        place do)."""
        return self._json(self._lib.fr_client_resume_ex_json, int(bool(recompute)))

    def abort(self, request_ids: Optional[Sequence[int]] = None) -> dict:
        """Ends the given requests (or every open one of this client). Each of
        their samples still comes out, once, of the call that waits for it
        (generate(), results(), events()) with finish_reason "abort" and what
        it made so far: tokens, log-probs, weight versions (and top log-probs
        when asked). Returns the server's reply (samples ended, not_found)."""
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
               prompt_logprobs: bool = False, min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: Optional[float] = None,
               continue_tokens: Optional[Sequence[int]] = None,
               stop: Optional[Sequence[str]] = None, include_stop_str_in_output: bool = False,
               add_special_tokens: Optional[bool] = None, return_text: Optional[bool] = None,
               return_routed_experts: bool = False, skip_special_tokens: bool = True) -> int:
        """Sends one generate and returns its request id (results come from results()).
        prompt_ids: text (the server's tokenizer, or the client's), or token ids
        as a list, tuple, numpy or torch integer array. stop: stop strings (the
        server ends a sample as soon as its text holds one; .text stops before
        it unless include_stop_str_in_output; .stop_str names it); return_text:
        the server's text in .text and every TokenDelta (None: yes whenever
        this client uses the server's tokenizer, which it learns from hello(),
        tokenizer="server", or a first call with text or stop);
        skip_special_tokens False: the server's text holds the special tokens
        too (stop strings may then match them);
        add_special_tokens (a text prompt for the server's tokenizer): its BOS
        and the like (None: yes). The samples are numbered first_sample ..
        first_sample + n - 1, and sample i draws from the seed's stream i: a
        sample s replays alone with seed=s.seed, first_sample=s.sample, n=1 and
        the same prompt and parameters (docs/sampling.md, "Seeds"). min_tokens:
        the stop tokens are barred until that many tokens were generated;
        logprobs=k (k <= 20): every token's k most likely tokens and their
        log-probs (SampleResult.top_logprobs); prompt_logprobs: the prompt
        tokens' log-probs in the first sample's result. min_p, presence_penalty,
        frequency_penalty and repetition_penalty (None or 1: off) change the
        draws, not the reported log-probs (docs/sampling.md, "Penalties and
        min_p"). max_tokens beyond
        the context window (hello()["max_model_len"] minus the prompt) and
        stop ids outside the vocabulary are refused (ServerError
        invalid_request naming the request); without max_tokens the server's
        default applies, cut to the window. continue_tokens (n=1): the
        tokens a sample already made, to continue it (continue_sample()
        fills it in from a SampleResult). return_routed_experts (a model with
        MoE layers; others refuse it, ServerError invalid_request): the experts
        every MoE layer chose for each token, in SampleResult.routed_experts,
        to replay the routing in the trainer's forward pass
        (docs/deepseek_moe.md, "Routed-expert replay")."""
        opts = {k: v for k, v in locals().items() if k in _OPTIONS}
        return self._send([self._ids(prompt_ids)], opts, request_id, False)[0]

    def _reserve(self, k: int, first: Optional[int] = None) -> List[int]:
        """k consecutive request ids: from first, or the next unused ones."""
        with self._lock:
            start = self._next_id if first is None else int(first)
            self._next_id = max(self._next_id, start + k)
        return list(range(start, start + k))

    def _request(self, rid: int, prompt: List[int], o: dict):
        """The C generate of one prompt, and the arrays it points to. A number
        the C struct cannot hold is refused (ServerError invalid_request),
        never wrapped into another."""
        if not 0 <= rid < 1 << 64:
            raise ClientError(f"request_id {rid} is not a 64-bit unsigned integer")
        g = _native.Generate()
        keep = []
        g.request_id = rid
        if isinstance(prompt, str):   # for the server's tokenizer
            raw = prompt.encode("utf-8")
            keep.append(raw)
            g.prompt_text, g.prompt_text_len = raw, len(raw)
            if o["add_special_tokens"] is not None:
                g.has_add_special_tokens, g.add_special_tokens = 1, int(bool(o["add_special_tokens"]))
        else:
            arr = _id_array(prompt, "prompt token", rid)
            keep.append(arr)
            g.prompt, g.n_prompt = arr, len(prompt)
        self._request_text(g, keep, isinstance(prompt, str), o)
        g.prompt_logprobs = int(bool(o["prompt_logprobs"]))
        g.return_routed_experts = int(bool(o["return_routed_experts"]))
        for key in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if o[key] is not None:
                setattr(g, key, float(o[key]))
        for key, flag, conv in (("n", None, int), ("first_sample", None, int), ("min_tokens", None, int),
                                ("logprobs", None, int), ("group_id", "has_group_id", int),
                                ("temperature", "has_temperature", float), ("top_k", "has_top_k", int),
                                ("top_p", "has_top_p", float), ("max_tokens", "has_max_tokens", int),
                                ("seed", "has_seed", int)):
            if o[key] is None:
                continue
            v = conv(o[key])
            wide = key in ("group_id", "seed")
            if conv is int and not (0 <= v < 1 << 64 if wide else -(1 << 31) <= v < 1 << 31):
                raise ServerError("invalid_request", f"request {rid}: {key} {v} is out of range (refused before "
                                                     f"sending)", rid)
            if flag:
                setattr(g, flag, 1)
            setattr(g, key, v)
        if o["stop_token_ids"] is not None:
            stops = _id_array(o["stop_token_ids"], "stop id", rid)
            keep.append(stops)
            g.has_stop_token_ids, g.stop_token_ids, g.n_stop_token_ids = 1, stops, len(o["stop_token_ids"])
        g.monitor_divergence = -1 if o["monitor"] is None else int(bool(o["monitor"]))
        g.per_token_kl = int(bool(o["per_token_kl"]))
        if o["forced_tokens"] is not None:
            forced = _id_array(o["forced_tokens"], "forced token", rid)
            keep.append(forced)
            g.forced_tokens, g.n_forced_tokens = forced, len(o["forced_tokens"])
        if o["continue_tokens"]:
            cont = _id_array(o["continue_tokens"], "continued token", rid)
            keep.append(cont)
            g.continue_tokens, g.n_continue_tokens = cont, len(o["continue_tokens"])
        return g, keep

    def _request_text(self, g, keep: list, text_prompt: bool, o: dict) -> None:
        """The stop strings and the text flags of a generate."""
        stops = o["stop"]
        if isinstance(stops, str):
            stops = [stops]
        if stops is not None:
            raw = [str(s).encode("utf-8") for s in stops]
            if not raw:
                raise ClientError("stop: give at least one stop string (or None)")
            arr = (ctypes.c_char_p * len(raw))(*raw)
            keep += [raw, arr]
            g.stop, g.n_stop = arr, len(raw)
        g.include_stop_str_in_output = int(bool(o["include_stop_str_in_output"]))
        g.keep_special_tokens = int(not o["skip_special_tokens"])
        want = o["return_text"]
        if want is None:   # asking the server only where text is in play: a call on ids alone never waits for hello
            want = self.tokenizer is None and (self._server_text or ((text_prompt or stops is not None) and
                                                                     self._server_has_text()))
        g.return_text = int(bool(want))

    def _server_has_text(self) -> bool:
        """Whether the server turns text into ids and back (its hello's tokenizer); asked once."""
        if self._server_text is None:
            self.hello()
        return bool(self._server_text)

    def _send(self, prompts: List[List[int]], opts: dict, first_id: Optional[int], owned: bool) -> List[int]:
        """Sends one request per prompt (ids consecutive), every one checked
        before any is sent; when one cannot be sent, those sent are aborted."""
        ids = self._reserve(len(prompts), first_id)
        built = [self._request(rid, p, opts) for rid, p in zip(ids, prompts)]
        send = self._lib.fr_client_generate_owned if owned else self._lib.fr_client_generate
        for k, (g, _keep) in enumerate(built):
            if send(self._c, ctypes.byref(g)):
                try:
                    self._raise()
                finally:
                    if k:
                        _Drain(self, ids[:k], False, None, "generate").close()
        return ids

    def open_samples(self) -> int:
        """Samples of the requests sent with submit() not yet handed out."""
        return self._lib.fr_client_open_samples(self._c)

    def lost(self) -> bool:
        """True once the connection to the server ended with samples open
        (the server was killed or went silent for 3 s): results() then
        raises ClientError naming the requests whose samples will not end
        (docs/failures.md)."""
        return bool(self._lib.fr_client_lost(self._c))

    def resubmit(self) -> int:
        """Sends every lost request (sent on a connection that ended with its
        samples still to come) again, under its own request id, e.g. to a
        restarted server (a server that still has the request refuses the
        copy: request ids make this idempotent); what was streamed of their
        samples is dropped. Returns how many requests went out."""
        n = ctypes.c_int(0)
        if self._lib.fr_client_resubmit(self._c, ctypes.byref(n)):
            self._raise()
        return n.value

    def results(self, timeout_ms: Optional[int] = None) -> Iterator[SampleResult]:
        """Yields the finished samples of the requests sent with submit() (any
        finish reason: an aborted sample comes with what it made), each once,
        until none is open. A refused request raises ServerError (code,
        message, request_id). timeout_ms: a deadline for the whole iteration
        (None: none); when it passes, the open requests are aborted and
        DeadlineExceeded names them (what they made in its .samples)."""
        return _Drain(self, None, False, timeout_ms, "results")

    def events(self, timeout_ms: Optional[int] = None) -> Iterator[Union[TokenDelta, SampleResult]]:
        """Streams: yields every TokenDelta as it arrives and every SampleResult
        as its sample finishes (after its last delta), for the requests sent
        with submit(), until none is open. A sample's deltas concatenated are
        its result's tokens. Errors and timeout_ms as for results()."""
        return _Drain(self, None, True, timeout_ms, "events")

    def generate(self, prompt_ids, n: int = 1, temperature: Optional[float] = None, top_k: Optional[int] = None,
                 top_p: Optional[float] = None, max_tokens: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, seed: Optional[int] = None,
                 monitor: Optional[bool] = None, per_token_kl: bool = False,
                 forced_tokens: Optional[Sequence[int]] = None, group_id: Optional[int] = None,
                 first_sample: int = 0, min_tokens: int = 0, logprobs: int = 0,
                 prompt_logprobs: bool = False, min_p: float = 0.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: Optional[float] = None,
                 continue_tokens: Optional[Sequence[int]] = None,
                 stop: Optional[Sequence[str]] = None, include_stop_str_in_output: bool = False,
                 add_special_tokens: Optional[bool] = None, return_text: Optional[bool] = None,
                 return_routed_experts: bool = False, skip_special_tokens: bool = True,
                 timeout_ms: Optional[int] = None) -> Iterator[SampleResult]:
        """Submits one prompt (text, or token ids as a list, tuple, numpy or torch
        integer array) or several (a list of such prompts, request ids in order)
        and yields every sample of these requests, and only of these, as it
        finishes, in the order they finish (each once; an aborted one with
        finish_reason "abort" and what it made). monitor None lets the
        server's kl_sample_rate decide. timeout_ms: a deadline for the whole
        call (None: none); when it passes, the call's requests are aborted on
        the server and DeadlineExceeded is raised, naming them, with what they
        made in its .samples; nothing of them reaches a later call. The
        iterator owns the requests: dropping it before its end, or an error,
        aborts what is still open. stop, include_stop_str_in_output,
        add_special_tokens, return_text, return_routed_experts and
        skip_special_tokens as for submit()."""
        opts = {k: v for k, v in locals().items() if k in _OPTIONS}
        ids = self._send(self._prompts(prompt_ids, "generate"), opts, None, True)
        return _Drain(self, ids, False, timeout_ms, "generate")

    def continue_sample(self, prompt_ids, sample: SampleResult, timeout_ms: Optional[int] = None,
                        **kwargs) -> SampleResult:
        """Generates the rest of `sample`, a partial sample of a request for
        prompt_ids (e.g. one ended by abort() or pause("abort")), and returns
        the whole sample (stitch()): its tokens so far are sent as
        continue_tokens with its seed and index (seed, first_sample, n=1) and
        group, and kwargs should repeat the original request's sampling
        options (temperature, top_k, top_p, max_tokens, which counts the
        whole sample, stop_token_ids, min_tokens, logprobs). The server puts
        the tokens in the KV cache after the prompt and draws the next one
        with the step of the sample's random stream it would have used, so
        in deterministic mode the whole sample is bitwise the one an
        uninterrupted request gives (docs/sampling.md, "Continuing a
        sample")."""
        rest = list(self.generate(prompt_ids, timeout_ms=timeout_ms, **continuation_options(sample, kwargs)))
        return stitch(sample, rest[0], self.tokenizer)

    def generate_stream(self, prompt_ids, timeout_ms: Optional[int] = None,
                        **kwargs) -> Iterator[Union[TokenDelta, SampleResult]]:
        """generate() with token-level streaming: submits the prompt(s) (request
        ids in order) with submit()'s keywords and yields what events() yields,
        for these requests only: each sample's tokens as they are drawn, then
        the sample. timeout_ms and ownership as for generate()."""
        unknown = set(kwargs) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"generate_stream: unknown keyword {sorted(unknown)[0]!r}")
        ids = self._send(self._prompts(prompt_ids, "generate_stream"), {**_OPTIONS, **kwargs}, None, True)
        return _Drain(self, ids, True, timeout_ms, "generate_stream")

    def _prompts(self, prompt_ids, what: str) -> List[List[int]]:
        prompts = [prompt_ids] if _text.is_single_prompt(prompt_ids) else list(prompt_ids)
        if not prompts:
            raise ClientError(f"{what}: no prompt given")
        return [self._ids(p) for p in prompts]   # all checked before any is sent

    # ---- what the calls (_calls.Drain) and the asyncio client use ----

    def _wait(self, ids: Optional[List[int]], deltas: bool, wait_ms: int, keep_delta=None):
        """The next event of the requests ids (None: of every request sent with
        submit()) within wait_ms: a TokenDelta (deltas only), a SampleResult,
        or None when none came or none is open; a refused request raises its
        ServerError (the event's own: safe with threads). keep_delta(request
        id), when given, says which deltas are worth converting (the others
        give None)."""
        arr = (ctypes.c_uint64 * len(ids))(*ids) if ids else None
        ev = _native.Event()
        if self._lib.fr_client_wait_event(self._c, arr, len(ids) if ids else 0, int(deltas), int(wait_ms),
                                          ctypes.byref(ev)):
            self._raise()
        try:
            skip = ev.kind == _native.EVENT_DELTA and keep_delta is not None and not keep_delta(ev.request_id)
            out = None if skip else _from_event(ev, self.tokenizer)
        finally:
            self._lib.fr_client_event_free(ctypes.byref(ev))
        if isinstance(out, ServerError):
            raise out
        return out

    def _open_of(self, ids: Optional[List[int]]) -> int:
        if ids is None:
            return self.open_samples()
        arr = (ctypes.c_uint64 * max(1, len(ids)))(*ids)
        return self._lib.fr_client_open_samples_of(self._c, arr, len(ids))

    def _open_requests(self) -> List[int]:
        n = self._lib.fr_client_open_requests(self._c, None, 0)
        arr = (ctypes.c_uint64 * max(1, n))()
        n = min(n, self._lib.fr_client_open_requests(self._c, arr, n))
        return list(arr[:n])

    def _discard(self, ids: List[int]) -> None:
        arr = (ctypes.c_uint64 * max(1, len(ids)))(*ids)
        self._lib.fr_client_discard(self._c, arr, len(ids))

    def _ids(self, prompt):
        """A prompt as sent: its ids, or (for the server's tokenizer) its text."""
        if isinstance(prompt, str) and self.tokenizer is None and not self._tokenizer_checked:
            self._tokenizer_checked = True
            if not self._server_has_text():   # a server that predates its tokenizer
                hello = self.hello()
                if _text.is_byte_vocabulary(hello):
                    self.tokenizer = ByteTokenizer(int(hello["vocab_size"]))
        if isinstance(prompt, str) and self.tokenizer is None and self._server_text:
            if not prompt:
                raise ClientError("prompt is empty")
            return prompt
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


def continuation_options(sample: SampleResult, kwargs: dict) -> dict:
    """generate()'s keywords that continue `sample`: its tokens as
    continue_tokens, its seed, index and group, over the caller's sampling
    options."""
    if sample.start != 0:
        raise ClientError(f"continue_sample: sample {sample.sample} holds tokens from {sample.start} on: stitch() it "
                          f"to the part before first")
    if sample.seed is None:
        raise ClientError(f"continue_sample: sample {sample.sample} of request {sample.request_id} has no seed (the "
                          f"server did not report it)")
    unknown = set(kwargs) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"continue_sample: unknown keyword {sorted(unknown)[0]!r}")
    # The original request's keywords may come as they were: its n and
    # first_sample give way to the sample's own index; a seed must be the
    # sample's; what a continuation cannot have is refused.
    if kwargs.get("seed") not in (None, sample.seed):
        raise ClientError(f"continue_sample: seed {kwargs['seed']} is not sample {sample.sample}'s ({sample.seed})")
    for key in ("continue_tokens", "forced_tokens", "prompt_logprobs"):
        if kwargs.get(key):
            raise ClientError(f"continue_sample: {key} does not go with a continuation")
    return {**kwargs, "n": 1, "first_sample": sample.sample, "seed": sample.seed, "forced_tokens": None,
            "prompt_logprobs": False, "group_id": kwargs.get("group_id", sample.group_id),
            "continue_tokens": list(sample.token_ids)}


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
