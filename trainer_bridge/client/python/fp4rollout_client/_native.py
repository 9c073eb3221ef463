"""ctypes declarations of the C client library (trainer_bridge/client/client.h).

The structures mirror the C ones field for field; the library is
libfp4rollout_client.so (`make build/libfp4rollout_client.so`), found as
_find_library says: no environment variable is needed.
"""
import ctypes
import glob
import os

LIB_NAME = "libfp4rollout_client.so"

c_int, c_u64, c_dbl, c_char_p = ctypes.c_int, ctypes.c_uint64, ctypes.c_double, ctypes.c_char_p


class Divergence(ctypes.Structure):
    _fields_ = [("has_values", c_int), ("kl_mean", c_dbl), ("kl_max", c_dbl), ("top1_agreement", c_dbl),
                ("logprob_diff_mean", c_dbl), ("positions", c_int), ("kl", ctypes.POINTER(ctypes.c_float)),
                ("n_kl", c_int)]


class Generate(ctypes.Structure):
    _fields_ = [("request_id", c_u64), ("has_group_id", c_int), ("group_id", c_u64),
                ("prompt", ctypes.POINTER(c_int)), ("n_prompt", c_int), ("n", c_int), ("first_sample", c_int),
                ("has_temperature", c_int), ("has_top_k", c_int), ("has_top_p", c_int), ("has_max_tokens", c_int),
                ("has_stop_token_ids", c_int), ("has_seed", c_int), ("temperature", c_dbl), ("top_k", c_int),
                ("top_p", c_dbl), ("max_tokens", c_int), ("stop_token_ids", ctypes.POINTER(c_int)),
                ("n_stop_token_ids", c_int), ("seed", c_u64), ("monitor_divergence", c_int),
                ("per_token_kl", c_int), ("forced_tokens", ctypes.POINTER(c_int)), ("n_forced_tokens", c_int),
                ("min_tokens", c_int), ("logprobs", c_int), ("prompt_logprobs", c_int),
                ("min_p", c_dbl), ("presence_penalty", c_dbl), ("frequency_penalty", c_dbl),
                ("repetition_penalty", c_dbl),
                ("continue_tokens", ctypes.POINTER(c_int)), ("n_continue_tokens", c_int),
                ("prompt_text", c_char_p), ("prompt_text_len", ctypes.c_size_t), ("has_add_special_tokens", c_int),
                ("add_special_tokens", c_int), ("stop", ctypes.POINTER(c_char_p)), ("n_stop", c_int),
                ("include_stop_str_in_output", c_int), ("return_text", c_int), ("return_routed_experts", c_int),
                ("keep_special_tokens", c_int)]


class Sample(ctypes.Structure):
    _fields_ = [("request_id", c_u64), ("group_id", c_u64), ("sample", c_int), ("start", c_int), ("n_tokens", c_int),
                ("token_ids", ctypes.POINTER(c_int)), ("logprobs", ctypes.POINTER(ctypes.c_float)),
                ("weight_versions", ctypes.POINTER(c_u64)), ("finish_reason", ctypes.c_char * 8),
                ("n_prompt", c_int), ("preemptions", c_int), ("has_ttft", c_int), ("ttft_ms", c_dbl),
                ("total_ms", c_dbl), ("divergence", Divergence), ("has_seed", c_int), ("seed", c_u64),
                ("top_k", c_int), ("top_token_ids", ctypes.POINTER(c_int)),
                ("top_logprobs", ctypes.POINTER(ctypes.c_float)), ("prompt_logprobs", ctypes.POINTER(ctypes.c_float)),
                ("n_prompt_logprobs", c_int), ("has_text", c_int), ("text", ctypes.POINTER(ctypes.c_char)),
                ("text_len", ctypes.c_size_t), ("stop_str", c_char_p), ("prompt_token_ids", ctypes.POINTER(c_int)),
                ("n_prompt_token_ids", c_int), ("routed_experts", ctypes.POINTER(ctypes.c_uint8)),
                ("route_layers", c_int), ("route_k", c_int), ("route_width", c_int)]


class Delta(ctypes.Structure):
    _fields_ = [("request_id", c_u64), ("sample", c_int), ("start", c_int), ("n", c_int),
                ("token_ids", ctypes.POINTER(c_int)), ("logprobs", ctypes.POINTER(ctypes.c_float)),
                ("weight_versions", ctypes.POINTER(c_u64)), ("has_text", c_int),
                ("text", ctypes.POINTER(ctypes.c_char)), ("text_len", ctypes.c_size_t)]


class Event(ctypes.Structure):
    """fr_client_event: what fr_client_wait_event hands out."""
    _fields_ = [("kind", c_int), ("request_id", c_u64), ("delta", Delta), ("sample", ctypes.POINTER(Sample)),
                ("code", ctypes.c_char * 256), ("message", ctypes.c_char * 1024), ("msg_", ctypes.c_void_p)]


EVENT_NONE, EVENT_DELTA, EVENT_SAMPLE, EVENT_ERROR = 0, 1, 2, 3


class Tensor(ctypes.Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int), ("ndim", c_int), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("data", ctypes.c_void_p)]


class UpdateOpts(ctypes.Structure):
    _fields_ = [("bucket_bytes", c_u64), ("corrupt_bucket", c_int), ("partial", c_int)]


class UpdateReply(ctypes.Structure):
    _fields_ = [("version", c_u64), ("stage", c_int), ("bucket", c_int), ("bytes", c_u64),
                ("weight_version", c_u64)]


class Curve(ctypes.Structure):
    _fields_ = [("server_public_key", c_char_p), ("public_key", c_char_p), ("secret_key", c_char_p)]


DTYPES = {"f32": 0, "bf16": 1, "f16": 2}
PAUSE_MODES = {"abort": 0, "wait": 1, "keep": 2}


def _find_library():
    """The library: $FP4ROLLOUT_CLIENT_LIB when set; else the copy an install
    put beside this file; else the build folder of the tree this package sits
    in ($BUILD, build/, or a folder under build/); else the system loader's."""
    env = os.environ.get("FP4ROLLOUT_CLIENT_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    packed = os.path.join(here, LIB_NAME)
    if os.path.exists(packed):
        return packed
    repo = os.path.normpath(os.path.join(here, "..", "..", "..", ".."))
    builds = [os.environ.get("BUILD"), "build"] + sorted(glob.glob(os.path.join(repo, "build", "*")))
    for build in builds:
        if build:
            path = os.path.join(build if os.path.isabs(build) else os.path.join(repo, build), LIB_NAME)
            if os.path.exists(path):
                return path
    return LIB_NAME


def load():
    lib = ctypes.CDLL(_find_library())
    P = ctypes.POINTER
    sig = {
        "fr_client_new_curve": (c_int, [c_char_p, P(Curve), P(ctypes.c_void_p)]),
        "fr_client_destroy": (None, [P(ctypes.c_void_p)]),
        "fr_client_set_timeout": (None, [ctypes.c_void_p, c_int]),
        "fr_client_generate": (c_int, [ctypes.c_void_p, P(Generate)]),
        "fr_client_generate_owned": (c_int, [ctypes.c_void_p, P(Generate)]),
        "fr_client_open_samples": (c_int, [ctypes.c_void_p]),
        "fr_client_open_samples_of": (c_int, [ctypes.c_void_p, P(c_u64), c_int]),
        "fr_client_open_requests": (c_int, [ctypes.c_void_p, P(c_u64), c_int]),
        "fr_client_discard": (c_int, [ctypes.c_void_p, P(c_u64), c_int]),
        "fr_client_wait_event": (c_int, [ctypes.c_void_p, P(c_u64), c_int, c_int, c_int, P(Event)]),
        "fr_client_event_free": (None, [P(Event)]),
        "fr_client_lost": (c_int, [ctypes.c_void_p]),
        "fr_client_resubmit": (c_int, [ctypes.c_void_p, P(c_int)]),
        "fr_client_update_weights": (c_int, [ctypes.c_void_p, P(Tensor), c_int, c_u64, P(UpdateOpts),
                                             P(UpdateReply)]),
        "fr_client_nccl_group_init": (c_int, [ctypes.c_void_p, c_int]),
        "fr_client_nccl_group_close": (c_int, [ctypes.c_void_p]),
        "fr_client_nccl_group_size": (c_int, [ctypes.c_void_p]),
        "fr_client_update_weights_nccl": (c_int, [ctypes.c_void_p, P(Tensor), c_int, c_u64, ctypes.c_void_p,
                                                  P(UpdateOpts), P(UpdateReply)]),
        "fr_client_send_raw": (c_int, [ctypes.c_void_p, c_char_p, ctypes.c_size_t, c_int]),
        "fr_client_last_error": (c_int, [ctypes.c_void_p, P(c_char_p), P(c_char_p), P(ctypes.c_longlong)]),
        "fr_client_hello_json": (c_int, [ctypes.c_void_p, c_char_p, P(ctypes.c_void_p)]),
        "fr_client_stats_json": (c_int, [ctypes.c_void_p, P(ctypes.c_void_p)]),
        "fr_client_pause_ex_json": (c_int, [ctypes.c_void_p, c_int, c_int, P(ctypes.c_void_p)]),
        "fr_client_resume_ex_json": (c_int, [ctypes.c_void_p, c_int, P(ctypes.c_void_p)]),
        "fr_client_abort_json": (c_int, [ctypes.c_void_p, P(c_u64), c_int, P(ctypes.c_void_p)]),
        "fr_client_free_string": (None, [ctypes.c_void_p]),
        "fr_client_error_text": (c_char_p, []),
        "fr_client_keypair": (c_int, [ctypes.c_char_p, ctypes.c_char_p]),
        "fr_metrics_sub_new": (c_int, [c_char_p, P(Curve), P(ctypes.c_void_p)]),
        "fr_metrics_sub_next": (c_int, [ctypes.c_void_p, c_int, P(ctypes.c_void_p)]),
        "fr_metrics_sub_destroy": (None, [P(ctypes.c_void_p)]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    return lib
