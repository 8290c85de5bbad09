"""OpenAI legacy Completions (`/v1/completions`) body → `Request` IR (pure; raises `ApiError` naming the bad parameter).

Owns: the `prompt` forms (a string, a list of strings, a list of token ids, a list of lists of token
ids: each prompt its own request, `per_prompt`), `echo` (with `logprobs`, the prompt's own logprobs too), the legacy integer `logprobs`, `best_of`,
and the refusals this server makes (`suffix`: the default model has no fill-in-the-middle format;
streaming more than one prompt).
Sampling fields are read by the chat parser's `sampling()`, shared by every OpenAI surface.
Must not: tokenize (the renderer does, at `prepare`), or know wire formats of the answer (encoders/).

Unknown fields are ignored, as OpenAI does. `user` is accepted and dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ingest.parsers import fields as f
from ingest.parsers.openai_chat import MAX_N, metadata, sampling
from shared.errors import invalid
from shared.ir import Protocol, Request, TextCompletion

ENDPOINT = "/v1/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint (chat's is "up to the context")
MAX_PROMPTS = 32
MAX_LOGPROBS = 5  # the legacy form's cap (OpenAI's)
MAX_PARTS = 64  # prompts x best_of: each is its own queued request

Prompt = str | tuple[int, ...]


def parse(body: Any, *, request_id: str, created: float) -> Request:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.", None, "invalid_body")
    model = f.string(f.require(body, "model"), "model", allow_empty=False)
    prompts = prompt_list(f.require(body, "prompt"))
    if body.get("suffix") not in (None, ""):
        f.string(body["suffix"], "suffix")
        raise invalid(f"The model {model} has no fill-in-the-middle format, so 'suffix' is not supported.", "suffix", "unsupported_parameter")
    stream = f.boolean(body["stream"], "stream") if body.get("stream") is not None else False
    include_usage = _include_usage(body, stream)
    echo = f.boolean(body["echo"], "echo") if body.get("echo") is not None else False
    logprobs = f.integer(body["logprobs"], "logprobs", lo=0, hi=MAX_LOGPROBS) if body.get("logprobs") is not None else None
    general = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs", "max_completion_tokens", "max_tokens")}
    params = sampling(general)
    n = params.n
    best_of = _best_of(body, n=n, stream=stream)
    if len(prompts) * best_of > MAX_PARTS:
        raise invalid(f"At most {MAX_PARTS} completions per request (prompts x best_of); got {len(prompts) * best_of}.", "prompt", "too_many_completions")
    max_tokens = f.integer(body["max_tokens"], "max_tokens", lo=1, hi=f.MAX_TOKENS_CAP) if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    return Request(
        id=request_id,
        protocol=Protocol.OPENAI_COMPLETIONS,
        model=model,
        messages=(),
        sampling=replace(
            params,
            n=best_of,
            max_tokens=max_tokens,
            logprobs=logprobs is not None or best_of > n,
            top_logprobs=logprobs or 0,
            prompt_logprobs=logprobs if echo else None,  # echo + logprobs: the prompt's tokens are scored too
        ),
        stream=stream,
        include_usage=include_usage,
        completion=_completion(prompts[0], echo=echo, index=0, n=n, logprobs=logprobs),
        return_token_ids=f.boolean(body["return_token_ids"], "return_token_ids") if body.get("return_token_ids") is not None else False,
        priority=f.integer(body["priority"], "priority", lo=-(2**31), hi=2**31) if body.get("priority") is not None else 0,
        created=created,
        metadata=metadata(body.get("metadata")),
        endpoint=ENDPOINT,
    )


def per_prompt(body: Any, request: Request, decode: Callable[[tuple[int, ...]], str]) -> list[Request]:
    """One request per prompt of the (already parsed) body, in order: the first keeps the request's id,
    the others get `<id>-p<i>`. A token-id prompt to echo gets its text from `decode`."""
    assert request.completion is not None
    out = []
    for i, prompt in enumerate(prompt_list(body["prompt"])):
        completion = _completion(prompt, echo=request.completion.echo, index=i, n=request.completion.n, logprobs=request.completion.logprobs)
        if completion.echo and completion.token_ids:
            completion = replace(completion, text=decode(completion.token_ids))
        out.append(replace(request, id=request.id if i == 0 else f"{request.id}-p{i}", completion=completion))
    return out


def prompt_list(value: Any) -> list[Prompt]:
    """The `prompt` forms OpenAI takes, as a list of prompts (text, or token ids); none may be empty."""
    if isinstance(value, str):
        return [_text(value, "prompt")]
    items = f.array(value, "prompt", max_items=f.MAX_TOKENS_CAP, allow_empty=False)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return [_token_ids(items, "prompt")]
    if len(items) > MAX_PROMPTS:
        raise invalid(f"Invalid 'prompt': at most {MAX_PROMPTS} prompts per request, got {len(items)}.", "prompt", "array_above_max_length")
    if all(isinstance(v, str) for v in items):
        return [_text(v, f"prompt[{i}]") for i, v in enumerate(items)]
    if all(isinstance(v, list) for v in items):
        return [_token_ids(f.array(v, f"prompt[{i}]", max_items=f.MAX_TOKENS_CAP, allow_empty=False), f"prompt[{i}]") for i, v in enumerate(items)]
    raise invalid(
        "Invalid 'prompt': expected a string, an array of strings, an array of token ids, or an array of arrays of token ids.", "prompt", "invalid_type"
    )


def _text(value: str, param: str) -> str:
    if not value:
        raise invalid(f"Invalid '{param}': the prompt cannot be empty.", param, "empty_string")
    return value


def _token_ids(values: list[Any], param: str) -> tuple[int, ...]:
    return tuple(f.integer(v, param, lo=0) for v in values)


def _completion(prompt: Prompt, *, echo: bool, index: int, n: int, logprobs: int | None) -> TextCompletion:
    text, ids = (prompt, ()) if isinstance(prompt, str) else ("", prompt)
    return TextCompletion(text=text, token_ids=ids, echo=echo, prompt_index=index, n=n, logprobs=logprobs)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    if body.get("stream_options") is None:
        return False
    if not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    opts = f.obj(body["stream_options"], "stream_options")
    return f.boolean(opts["include_usage"], "stream_options.include_usage") if opts.get("include_usage") is not None else False


def _best_of(body: dict[str, Any], *, n: int, stream: bool) -> int:
    """`best_of` candidates per prompt (default n); at least n, and not with `stream`."""
    if body.get("best_of") is None:
        return n
    best_of = f.integer(body["best_of"], "best_of", lo=1, hi=MAX_N)
    if best_of < n:
        raise invalid(f"'best_of' ({best_of}) must be greater than or equal to 'n' ({n}).", "best_of", "invalid_value")
    if stream and best_of > 1:
        raise invalid("'best_of' greater than 1 cannot be used with 'stream'.", "best_of", "unsupported_value")
    return best_of
