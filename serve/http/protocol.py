"""The OpenAI request and response schema the server speaks, and its checks (400s name the field).

Requests are pydantic models with ``extra="forbid"`` and ``strict=True``: an unknown field or a wrong type (a
string for ``max_tokens``, a bool for an int) is a 400, never a silent coercion; its ``param`` is the field's
path as the client wrote it (``messages[0].content``, :func:`client_path`). ``temperature`` (0 to 2), ``top_p`` (0
to 1], ``seed`` (a 64-bit signed int) and vLLM's ``top_k`` (0 or -1: off, else >= 1) are honoured per request
(:class:`serve.engine.sampling.SamplingParams`: a seeded request's output is reproducible and equal to its batch-1 run);
``top_p`` / ``top_k`` are accepted at temperature 0, where they cannot change the argmax (as vLLM does).
``/v1/completions`` returns ``logprobs`` (an int in [0, :data:`MAX_LOGPROBS`]: each emitted token's natural-log
probability under the model's raw softmax and that many most likely alternatives, in the OpenAI completions format;
token strings are the byte's character, ``bytes:\\xNN`` for a byte that is not ASCII, or ``token_id:N`` with vLLM's
``return_tokens_as_token_ids``). Fields a byte-level engine cannot honour are accepted only at their neutral value
(``n`` 1, penalties 0, no ``stop``, no chat ``logprobs``, no ``echo``), else a 400 that says why; ``tools`` / ``tool_choice`` / ``functions`` get a 400 saying
tool calls are not supported (not "unknown field"). A few vLLM extensions that load generators send
(``ignore_eos``, ``min_tokens``, ``repetition_penalty`` 1) are accepted: the demo model has no end-of-sequence
token, so every request runs to ``max_tokens`` and finishes with ``finish_reason`` "length".

Bytes are tokens: a text prompt is its UTF-8 bytes (a lone surrogate, which JSON can carry, is a 400), a
token-id prompt is ints in [0, 255]; output bytes are decoded incrementally (:class:`TextDecoder`) with invalid
sequences replaced by U+FFFD, so streamed deltas concatenate to the non-streamed text. A chat is rendered to
one prompt by :func:`chat_prompt`.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from types import UnionType
from typing import Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field

from serve.engine.sampling import SamplingParams
from serve.text_codec import BYTES


class RequestError(ValueError):
    """An OpenAI-style error: ``status`` (400, 404, 429, 503), ``message``, ``param`` (the field) and ``type``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns it."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = None
    temperature: float | int | None = None
    top_p: float | int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions sent by load generators (vllm bench serve, guidellm)
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int | None = None
    repetition_penalty: float | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: text or byte ids (a one-element list of either is unwrapped)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    return_tokens_as_token_ids: bool = False          # vLLM's extension: logprobs' tokens as "token_id:N"


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # tool calling: parsed so that the answer can say it is not supported (clients send them by default)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


DEFAULT_MAX_TOKENS = 16                       # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20                             # vLLM's default --max-logprobs


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability: ``token`` (id), ``logprob`` (natural log, raw softmax of the logits)
    and ``top``: the most likely ``(id, logprob)`` pairs, most likely first."""

    token: int
    logprob: float
    top: tuple


def token_string(token: int, as_id: bool) -> str:
    """How a logprobs entry names a byte token: ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``), the
    character of an ASCII byte, else ``bytes:\\xNN`` (OpenAI's form for a token that is not whole UTF-8)."""
    if as_id:
        return f"token_id:{token}"
    return chr(token) if token < 128 else f"bytes:\\x{token:02x}"


def logprobs_body(ids: list, lps: list, as_ids: bool, before: list = ()) -> dict:
    """The OpenAI completions ``logprobs`` object of the emitted ``ids`` (after the ``before`` ids already sent in
    earlier stream chunks) and their :class:`TokenLogprob` ``lps``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (one dict per token) and ``text_offset`` (characters of the output text before each token)."""
    prev = list(before)
    offsets = [len(decode_all(prev + list(ids[:i]))) for i in range(len(ids))]
    return {"tokens": [token_string(t, as_ids) for t in ids], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_string(t, as_ids): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def client_path(model: type[BaseModel], loc: Sequence[str | int]) -> str | None:
    """A pydantic error location inside ``model`` as the client wrote the field: ``messages[0].content`` for
    ``("messages", 0, "content", "str")``. Pydantic adds the name of the union member it tried (``str``,
    ``list[TextPart]``, ``float``) to the location; those are dropped by following ``model``'s annotations,
    so a name is kept only where the schema has a field (or where the client sent an unknown one)."""
    parts, tp = [], model
    for item in loc:
        members = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (Union, UnionType) else []
        if len(members) > 1:                       # pydantic's tag naming the member it tried: skip it
            tp = next((m for m in members if _tag(m) == item), None)
            continue
        tp = members[0] if members else tp
        if isinstance(item, int):
            parts.append(f"[{item}]")
            args = get_args(tp)
            tp = args[-1] if args else None
        else:
            parts.append(f".{item}" if parts else str(item))
            field = tp.model_fields.get(item) if isinstance(tp, type) and issubclass(tp, BaseModel) else None
            tp = None if field is None else field.annotation
    return "".join(parts) or None


def _tag(tp) -> str:
    """Pydantic's name of a union member in an error location: ``str``, ``list[TextPart]``."""
    args = get_args(tp)
    name = getattr(get_origin(tp) or tp, "__name__", str(tp))
    return f"{name}[{','.join(map(_tag, args))}]" if args else name


def text_ids(text: str, param: str, codec=BYTES) -> list[int]:
    """The ids of ``text`` by the served model's ``codec`` (:mod:`serve.text_codec`; the shipped models: its UTF-8
    bytes). Raises RequestError naming ``param`` for text that is not valid UTF-8 (a lone surrogate)."""
    try:
        return codec.encode(text)
    except UnicodeEncodeError as err:
        raise RequestError(f"{param} is not valid UTF-8 ({err.reason} at character {err.start})", param) from None


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The byte model's chat template: ``<|role|>content\\n`` per message, then ``<|assistant|>``."""
    parts = []
    for msg in messages:
        content = msg.content if isinstance(msg.content, str) else "".join(p.text for p in msg.content)
        parts.append(f"<|{msg.role}|>{content}\n")
    return "".join(parts) + "<|assistant|>"


def prompt_of(req: CompletionRequest | ChatRequest, codec=BYTES, vocab_size: int = 256) -> list[int]:
    """The request's prompt as token ids (text through ``codec``; token ids as given). Raises RequestError for an
    empty or batched prompt, ids outside [0, vocab_size) or text that is not valid UTF-8."""
    if isinstance(req, ChatRequest):
        return text_ids(chat_prompt(req.messages), "messages", codec)
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise RequestError(f"prompt: one prompt per request (n = 1), got a batch of {len(p)}", "prompt")
        p = p[0]
    ids = text_ids(p, "prompt", codec) if isinstance(p, str) else list(p)
    if not ids:
        raise RequestError("prompt must not be empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        what = "bytes in [0, 255]" if vocab_size == 256 else f"ids of the model's vocabulary, in [0, {vocab_size - 1}]"
        raise RequestError(f"prompt token ids must be {what}, got {bad[0]}", "prompt")
    return ids


class Checked(NamedTuple):
    """A valid request: ``prompt`` byte ids, ``max_tokens``, ``sampling`` (:class:`SamplingParams`), ``logprobs``:
    alternatives per token to return (None: no logprobs)."""

    prompt: list
    max_tokens: int
    sampling: SamplingParams
    logprobs: int | None = None


TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


def sampling_of(req: CompletionRequest | ChatRequest) -> SamplingParams:
    """The request's :class:`SamplingParams` (temperature / top_p / top_k None: 0 (greedy) / 1 / 0 (off), the
    engine's defaults). Raises RequestError naming the field for a value out of range."""
    values = {"temperature": 0.0 if req.temperature is None else float(req.temperature),
              "top_p": 1.0 if req.top_p is None else float(req.top_p), "seed": req.seed,
              "top_k": 0 if req.top_k is None else req.top_k}
    try:
        return SamplingParams(**values)
    except (TypeError, ValueError) as err:
        param = next((k for k in values if str(err).startswith(k)), None)
        raise RequestError(str(err), param) from None


NOT_HONOURED = {
    "n": "returns one choice per request", "best_of": "returns one choice per request",
    "presence_penalty": "applies no penalties", "frequency_penalty": "applies no penalties",
    "repetition_penalty": "applies no penalties", "echo": "does not echo the prompt back in the completion",
    "logprobs": "returns no chat logprobs (/v1/completions does)", "top_logprobs": "returns no chat logprobs (/v1/completions does)",
    "suffix": "does not insert text before a suffix",
}
"""Why each field is accepted only at its neutral value (the 400's message: ``echo = True is not supported: this
server does not echo the prompt back ...``)."""


def check_request(req: CompletionRequest | ChatRequest, served_model: str, max_model_len: int, codec=BYTES,
                  vocab_size: int = 256) -> Checked:
    """The :class:`Checked` prompt, ``max_tokens`` and sampling of a valid request (text through the served model's
    ``codec``, token ids in [0, vocab_size)). Raises RequestError (404 for another model, else 400 naming the
    field) for what this server cannot do or a length over ``max_model_len``."""
    if req.model != served_model:
        raise RequestError(f"The model `{req.model}` does not exist; this server serves `{served_model}`.",
                           "model", 404, "NotFoundError")
    if isinstance(req, ChatRequest):
        for name in TOOL_FIELDS:
            if getattr(req, name) not in (None, [], "none"):
                raise RequestError(f"tool calls are not supported by this server ({name} was given): the demo model "
                                   "is a byte-level language model without a tool-call format; send the request "
                                   f"without {name}", name)
    sampling = sampling_of(req)
    neutral = {"n": (req.n, (1,)), "presence_penalty": (req.presence_penalty, (None, 0.0)),
               "frequency_penalty": (req.frequency_penalty, (None, 0.0)),
               "repetition_penalty": (req.repetition_penalty, (None, 1.0))}
    if isinstance(req, CompletionRequest):
        neutral |= {"echo": (req.echo, (False,)), "best_of": (req.best_of, (None, 1)), "suffix": (req.suffix, (None, ""))}
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    else:
        neutral |= {"logprobs": (req.logprobs, (False,)), "top_logprobs": (req.top_logprobs, (None, 0))}
    for name, (val, ok) in neutral.items():
        if val not in ok:
            raise RequestError(f"{name} = {val!r} is not supported: this server {NOT_HONOURED[name]} (allowed: "
                               f"{', '.join(map(repr, ok))})", name)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    if req.stop not in (None, "", []):
        raise RequestError("stop sequences are not supported (the demo model runs to max_tokens)", "stop")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported", "logit_bias")
    prompt = prompt_of(req, codec, vocab_size)
    if len(prompt) >= max_model_len:
        what, field = ("messages render to a prompt of", "messages") if isinstance(req, ChatRequest) else \
            ("prompt is", "prompt")
        raise RequestError(f"{what} {len(prompt)} tokens (bytes); this model's maximum context length is "
                           f"{max_model_len} tokens, and at least one must be generated", field)
    name, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        if max_tokens is not None:
            raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    room = max_model_len - len(prompt)
    if max_tokens is None:   # a default the client never sent fits the room left, as vLLM's get_max_tokens does
        max_tokens = min(DEFAULT_MAX_TOKENS, room) if isinstance(req, CompletionRequest) else room
    if not 1 <= max_tokens <= room:
        raise RequestError(f"{name} must be in [1, {room}] (max_model_len {max_model_len} - prompt {len(prompt)} "
                           f"tokens), got {max_tokens}", name)
    if not 0 <= req.min_tokens <= max_tokens:
        raise RequestError(f"min_tokens must be in [0, max_tokens = {max_tokens}], got {req.min_tokens}", "min_tokens")
    return Checked(prompt, max_tokens, sampling, req.logprobs if isinstance(req, CompletionRequest) else None)


class TextDecoder:
    """Incremental decoding of output ids by the served model's codec: a character split across tokens waits for
    its last token; an invalid sequence becomes U+FFFD (``errors="replace"``), the same text one decode of the
    whole output gives."""

    def __init__(self, codec=BYTES):
        self._dec = codec.decoder()

    def feed(self, ids: list[int], final: bool = False) -> str:
        return self._dec.feed(ids, final=final)


def decode_all(ids, codec=BYTES) -> str:
    """The text of a whole output (invalid UTF-8 replaced by U+FFFD)."""
    return codec.decode(ids)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None,
                    logprobs: dict | None = None) -> dict:
    """A ``text_completion`` object (or stream chunk: ``finish`` None until the last); ``logprobs``: its
    :func:`logprobs_body` (None: null)."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, chunk: bool,
              first: bool = False) -> dict:
    """A ``chat.completion`` object, or a ``chat.completion.chunk`` (its first delta carries the role)."""
    if chunk:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    body = {"id": rid, "object": "chat.completion.chunk" if chunk else "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body
