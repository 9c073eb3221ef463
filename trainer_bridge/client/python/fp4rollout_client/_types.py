"""What the clients hand out and raise: samples, token deltas, errors, and
their conversion from the C library's events."""
import ctypes
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from . import _native
from . import text as _text

# Token ids travel as 32-bit ints through the C library: anything else is
# refused before it is sent, never wrapped into another id.
_ID_MAX = (1 << 31) - 1


class ClientError(Exception):
    """A failure on the client side (connection, timeout, bad argument)."""


class ConnectError(ClientError, ConnectionError):
    """No server answers at the endpoint (the message names it)."""


class ServerError(Exception):
    """An error message from the server: code (e.g. bad_checksum, invalid_request), message and request_id.
    A request the client can tell is invalid before sending it (a token id that cannot be one) raises the
    same, with the code the server would give."""

    def __init__(self, code: str, message: str, request_id: Optional[int] = None):
        named = request_id is None or f"request {request_id}" in message
        super().__init__(f"{code}: {message}" + ("" if named else f" (request {request_id})"))
        self.code = code
        self.message = message
        self.request_id = request_id


class DeadlineExceeded(ClientError, TimeoutError):
    """A call's deadline passed with samples open. Its requests (request_ids)
    were aborted on the server; samples holds what the call had not handed
    out yet: the ones that finished, and the aborted ones with the tokens they
    made (finish_reason "abort"). Nothing of these requests reaches a later
    call."""

    def __init__(self, message: str, request_ids: Sequence[int], samples: List["SampleResult"]):
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.samples = samples


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
    # the sample's text: the server's (its tokenizer, cut before the stop string
    # that ended it) when the request asked for text, else the client
    # tokenizer's decode; None when neither
    text: Optional[str] = None
    # with logprobs=k: for every generated token, its k most likely tokens as
    # (token id, log-prob) pairs, best first (None when not asked)
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    # with prompt_logprobs=True, in the request's first sample: one entry per
    # prompt token, None for the first (nothing precedes it), else its log-prob
    # given the tokens before it
    prompt_logprobs: Optional[List[Optional[float]]] = None
    # a continuation (continue_tokens): token_ids[0] is token `start` of the
    # whole sample, the continued tokens being the ones before (stitch()
    # joins a partial sample and its continuation); 0 otherwise
    start: int = 0
    # the stop string that ended the sample (finish_reason "stop"), else None
    stop_str: Optional[str] = None
    # the prompt's token ids, when it was sent as text for the server's
    # tokenizer (what a trainer recomputes log-probs over), else None
    prompt_token_ids: Optional[List[int]] = None
    # with return_routed_experts=True: the experts every MoE layer chose for
    # each token (those of the forward pass that drew it), shape (n_tokens,
    # layers, k), each layer's k ids best first: a numpy array (uint8 or
    # uint16) when numpy is importable, else nested lists; None when not asked
    routed_experts: Optional[object] = None


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
    # the text these tokens made final: the server's when the request asked for
    # text (never half a character, nor the start of a stop string that may
    # still match; the deltas' texts joined are a prefix of the sample's), else
    # the client tokenizer's decode of these tokens (a character split between
    # deltas decodes with replacements); None when neither
    text: Optional[str] = None


def id_array(values: Sequence[int], what: str, request_id: int):
    """values as a C int array; an id that is not a non-negative 31-bit
    integer raises ServerError invalid_request naming the request."""
    out = []
    for v in values:
        v = int(v)
        if v < 0 or v > _ID_MAX:
            raise ServerError("invalid_request", f"request {request_id}: {what} {v} is outside the vocabulary "
                                                 f"(refused before sending: token ids are below 2^31)", request_id)
        out.append(v)
    return (ctypes.c_int * max(1, len(out)))(*out)


def _text_of(has, ptr, n) -> Optional[str]:
    """The server's text (UTF-8 bytes), or None when it sent none."""
    if not has:
        return None
    return ctypes.string_at(ptr, n).decode("utf-8", errors="replace") if n else ""


def routes_from_bytes(raw: bytes, n_tokens: int, layers: int, k: int, width: int):
    """Routed experts as the server sends them (n_tokens x layers x k ids,
    each `width` bytes, little endian) as an array of shape (n_tokens,
    layers, k): numpy's when it is importable, else nested lists."""
    if len(raw) != n_tokens * layers * k * width or width not in (1, 2):
        raise ClientError(f"routed experts: {len(raw)} bytes for {n_tokens} x {layers} x {k} ids of {width} bytes")
    try:
        import numpy as np
    except ImportError:
        ids = raw if width == 1 else [raw[i] | raw[i + 1] << 8 for i in range(0, len(raw), 2)]
        return [[list(ids[(t * layers + m) * k:(t * layers + m + 1) * k]) for m in range(layers)]
                for t in range(n_tokens)]
    return np.frombuffer(raw, dtype="<u1" if width == 1 else "<u2").reshape(n_tokens, layers, k).copy()


def _join_routes(a, b):
    """Two samples' routed experts, one after the other (None unless both
    have them)."""
    if a is None or b is None:
        return None
    if isinstance(a, list):
        return a + (b.tolist() if hasattr(b, "tolist") else list(b))
    import numpy as np
    return np.concatenate([a, np.asarray(b, dtype=a.dtype)])


def _routes_of(s):
    """A C sample's routed experts (routes_from_bytes), None when absent."""
    if not s.routed_experts:
        return None
    n = s.n_tokens * s.route_layers * s.route_k * s.route_width
    return routes_from_bytes(ctypes.string_at(s.routed_experts, n), s.n_tokens, s.route_layers, s.route_k,
                             s.route_width)


def stitch(partial: SampleResult, continuation: SampleResult, tokenizer=None) -> SampleResult:
    """The whole sample: `partial` (tokens 0 .. k-1 of a sample, e.g. ended by
    abort) followed by `continuation` (the result of continuing it, start k):
    token ids, log-probs, weight versions, top log-probs and routed experts
    (when both have them, else None) concatenated; the
    finish reason, timings and divergence figures of the continuation;
    preemptions summed; start that of `partial`."""
    k = partial.start + len(partial.token_ids)
    if continuation.start != k or continuation.sample != partial.sample:
        raise ClientError(f"stitch: the continuation (sample {continuation.sample}, start {continuation.start}) does "
                          f"not follow sample {partial.sample}, which ends at token {k}")
    top = None
    if partial.top_logprobs is not None or continuation.top_logprobs is not None:
        top = (partial.top_logprobs or []) + (continuation.top_logprobs or [])
    ids = partial.token_ids + continuation.token_ids
    # The server's text of a continuation is what its tokens add to the
    # whole sample's (decoded after the continued ones), so the texts join.
    if partial.text is not None and continuation.text is not None and tokenizer is None:
        text = partial.text + continuation.text
    else:
        text = _text.decode(tokenizer, ids) if tokenizer is not None else None
    return SampleResult(request_id=continuation.request_id, group_id=continuation.group_id, sample=partial.sample,
                        token_ids=ids, logprobs=partial.logprobs + continuation.logprobs,
                        weight_versions=partial.weight_versions + continuation.weight_versions,
                        finish_reason=continuation.finish_reason, n_prompt=partial.n_prompt,
                        preemptions=partial.preemptions + continuation.preemptions,
                        ttft_ms=partial.ttft_ms if partial.ttft_ms is not None else continuation.ttft_ms,
                        total_ms=continuation.total_ms, divergence=continuation.divergence,
                        seed=continuation.seed if continuation.seed is not None else partial.seed,
                        text=text, top_logprobs=top, prompt_logprobs=partial.prompt_logprobs, start=partial.start,
                        stop_str=continuation.stop_str, prompt_token_ids=partial.prompt_token_ids,
                        routed_experts=_join_routes(partial.routed_experts, continuation.routed_experts))


def _sample(s, tokenizer) -> SampleResult:
    n = s.n_tokens
    d = s.divergence
    div = {"kl_mean": None, "kl_max": None, "top1_agreement": None, "logprob_diff_mean": None, "positions": None,
           "per_token_kl": None}
    if d.has_values:
        div.update(kl_mean=d.kl_mean, kl_max=d.kl_max, top1_agreement=d.top1_agreement,
                   logprob_diff_mean=d.logprob_diff_mean, positions=d.positions)
        if d.kl:
            div["per_token_kl"] = d.kl[:d.n_kl]
    k = s.top_k
    top = [[(s.top_token_ids[i * k + j], s.top_logprobs[i * k + j]) for j in range(k)] for i in range(n)] \
        if k > 0 else None
    ids = s.token_ids[:n] if n else []
    return SampleResult(request_id=s.request_id, group_id=s.group_id, sample=s.sample, token_ids=ids,
                        logprobs=s.logprobs[:n] if n else [], weight_versions=s.weight_versions[:n] if n else [],
                        finish_reason=s.finish_reason.decode(), n_prompt=s.n_prompt, preemptions=s.preemptions,
                        ttft_ms=s.ttft_ms if s.has_ttft else None, total_ms=s.total_ms, divergence=div,
                        seed=s.seed if s.has_seed else None, top_logprobs=top,
                        prompt_logprobs=[None] + s.prompt_logprobs[:s.n_prompt_logprobs]
                        if s.prompt_logprobs else None,
                        text=_text_of(s.has_text, s.text, s.text_len) if s.has_text else _text.decode(tokenizer, ids),
                        stop_str=s.stop_str.decode("utf-8", errors="replace") if s.stop_str else None,
                        prompt_token_ids=s.prompt_token_ids[:s.n_prompt_token_ids] if s.prompt_token_ids else None,
                        start=s.start, routed_experts=_routes_of(s))


def from_event(ev: "_native.Event", tokenizer):
    """The Python object of a C event (the event is not freed here): a
    TokenDelta, a SampleResult, a ServerError (a refused request, to raise),
    or None."""
    if ev.kind == _native.EVENT_DELTA:
        d = ev.delta
        ids = d.token_ids[:d.n]
        return TokenDelta(request_id=d.request_id, sample=d.sample, start=d.start, token_ids=ids,
                          logprobs=d.logprobs[:d.n], weight_versions=d.weight_versions[:d.n],
                          text=_text_of(d.has_text, d.text, d.text_len) if d.has_text else _text.decode(tokenizer, ids))
    if ev.kind == _native.EVENT_SAMPLE:
        return _sample(ev.sample.contents, tokenizer)
    if ev.kind == _native.EVENT_ERROR:
        return ServerError(ev.code.decode(errors="replace"), ev.message.decode(errors="replace"), ev.request_id)
    return None
