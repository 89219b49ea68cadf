"""Requests: chat and completion bodies as pydantic models, with OpenAI-shaped errors.

The models (`ChatRequest`, `CompletionRequest`) check the wire shape and types: which
fields exist, their JSON types, and the bounds the wire itself sets (`n`, `max_tokens`,
the number of stop strings). Sampling ranges are not checked here: `GenRequest.params`
hands the values to `tokentrail.sampling.make_params` under its `OPENAI_LIMITS`
profile, the one place those ranges are decided.

Every error is a 400 naming the offending top-level field in `error.param` (as OpenAI
does) and its full path in the message (``'messages[0].content'``), so a client sees an
error it can act on instead of a 500 or a silent default. The body reader also turns
the JSON parser's own failures (integers of thousands of digits, lone surrogates, deep
nesting) into such errors. How pydantic's findings become those 400s:
`tokentrail.server.wire_errors`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..sampling import OPENAI_LIMITS, SamplingError, SamplingParams, is_int, make_params
from .llamacpp_fields import LlamaCppFields, llamacpp_extras
from .mlx_fields import MlxFields, mlx_extras
from .structured import Structure, StructuredFields, structure_of
from .tool_calls import ToolSpec, template_messages, with_tools
from .vllm_fields import ChatFields, CommonFields, CompletionFields, vllm_extras
from .voting import check_vote
from .wire_errors import bad_request, custom_error, json_type_name, validation_error

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
#: Most choices one request may ask for (`n`); each is one sequence of the batch.
MAX_N = 16
#: Largest `max_tokens` on the wire (a signed 32-bit int, as OpenAI's).
MAX_TOKENS_LIMIT = 2**31 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Kind = Literal["chat", "completion"]

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "GenRequest",
    "parse_chat",
    "parse_completion",
]


# -- shared wire types --------------------------------------------------------------------


class _Wire(BaseModel):
    """JSON as parsed: no coercion ("5" is not 5, true is not 1), finite numbers only,
    and unknown fields ignored (OpenAI clients send many)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


def _unicode(text: str) -> str:
    """Refuse text the tokenizer cannot encode: a lone UTF-16 surrogate (JSON allows
    ``"\\ud800"``, UTF-8 does not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise custom_error(
            "invalid_unicode",
            f"holds a lone surrogate {text[e.start]!r} at character {e.start}, "
            "which is not valid Unicode text",
        ) from None
    return text


def _stop_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise custom_error(
            "invalid_type", f"must be a string or an array of strings, got {json_type_name(value)}"
        )
    return value


def _stop_string(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise custom_error("invalid_value", "must not be empty")
        return _unicode(value)
    return value  # not a string: the str type reports it


StopString = Annotated[str, BeforeValidator(_stop_string)]
Stops = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS), BeforeValidator(_stop_list)]
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
#: A completion's `max_tokens`: 0 too, with ``echo`` (the prompt scored, nothing made).
CompletionTokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)]


class StreamOptions(_Wire):
    include_usage: bool | None = None


class _Common(_Wire, StructuredFields, CommonFields, LlamaCppFields, MlxFields):
    """The fields chat and completions share (the constraint fields and the
    ``tokentrail`` options: `tokentrail.server.structured`; vLLM's, llama-server's and
    mlx_lm.server's extra fields: `tokentrail.server.vllm_fields`, `.llamacpp_fields`,
    `.mlx_fields`)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: TokenCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
    stop: Stops | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise custom_error(
                "unsupported_value", f"must be 1 (the only value supported), got {value}"
            )
        return value

    def check_together(self) -> None:
        """Rules across fields (bad_request naming the field to change)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options", "'stream_options' is only allowed when 'stream' is true"
            )


# -- chat -----------------------------------------------------------------------------------


class TextPart(_Wire):
    type: Literal["text"]
    text: Annotated[str, BeforeValidator(lambda v: _unicode(v) if isinstance(v, str) else v)]


def _content(value: Any) -> Any:
    """A message's content: a string is one text part; null stays null (assistant)."""
    if isinstance(value, str):
        return [{"type": "text", "text": _unicode(value)}]
    if value is None or isinstance(value, list):
        return value
    raise custom_error(
        "invalid_type",
        f"must be a string or an array of text parts, got {json_type_name(value)}",
    )


class ChatMessage(_Wire):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Annotated[list[TextPart], BeforeValidator(_content)] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise custom_error(
                "invalid_type", "needs 'content': a string or an array of text parts"
            )
        return self

    def as_prompt(self) -> dict[str, Any]:
        """The message for the chat template (developer is the template's system)."""
        text = "".join(part.text for part in self.content or ())
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": text}  # fmt: skip
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Common, ChatFields):
    """A /v1/chat/completions body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None
    functions: Any = None

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value:
            raise custom_error(
                "unsupported_parameter", "(the legacy form) is not supported: use 'tools'"
            )
        return value

    def check_together(self) -> None:
        super().check_together()
        mct = self.max_completion_tokens
        if mct is not None and self.max_tokens is not None and self.max_tokens != mct:
            raise bad_request(
                "max_completion_tokens",
                "'max_tokens' and 'max_completion_tokens' disagree; give one of them",
            )


# -- completions --------------------------------------------------------------------------


def _prompt(value: Any, info: ValidationInfo) -> str | list[int]:
    """One prompt: a non-empty string or token ids inside the vocabulary."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise custom_error("invalid_value", "must not be empty")
        return _unicode(value)
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        size = (info.context or {}).get("vocab_size")
        bad = next((t for t in value if t < 0 or (size is not None and t >= size)), None)
        if bad is not None:
            span = "" if size is None else f" (0..{size - 1})"
            raise custom_error("invalid_value", f"token id {bad} is outside the vocabulary{span}")
        return [int(t) for t in value]
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        raise custom_error(  # the server splits them first (`server.prompts.split_prompts`)
            "unsupported_value",
            "holds several prompts; parse each on its own (the server's /v1/completions "
            "answers several, one job each)",
        )
    raise custom_error(
        "invalid_type",
        f"must be a string or a non-empty array of token ids, got {json_type_name(value)}",
    )


class CompletionRequest(_Common, CompletionFields):
    """A /v1/completions body."""

    prompt: Annotated[str | list[int], PlainValidator(_prompt)]
    logprobs: int | None = None
    #: The prompt returned before the completion (`tokentrail.server.echo`); with
    #: `max_tokens` 0 the prompt alone, scored (OpenAI's legacy way to score a text).
    echo: bool | None = None
    max_tokens: CompletionTokenCount | None = None
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value is not None:
            raise custom_error("unsupported_parameter", "is not supported")
        return value


# -- the scheduler's view ---------------------------------------------------------------------


#: Wire names of the sampling settings, where they differ from `make_params`'s.
_CHAT_LABELS = {"temp": "temperature"}
_COMPLETION_LABELS = {"temp": "temperature", "top_logprobs": "logprobs"}


@dataclass
class GenRequest:
    """A validated request, in the terms the scheduler takes."""

    kind: Kind
    prompt: str | list[int] | list[dict[str, str]]
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    #: Whether the client set `max_tokens`: a default is cut to the room the context has
    #: left, an explicit value beyond it is an error (as in vLLM and OpenAI).
    max_tokens_given: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    logit_bias: dict[str, float] | dict[int, float] | None = None
    #: Whether OpenAI `logprobs` are returned, and how many alternatives per token.
    logprobs: bool = False
    top_logprobs: int = 0
    #: The constraint, logprobs distribution, fields and reasoning asked for.
    structure: Structure = field(default_factory=Structure)
    #: The tools for the chat template (OpenAI's shape), and the parser the reply goes
    #: through (set by the scheduler from `structure.tool_choice`).
    tools: list[dict[str, Any]] | None = None
    #: The sampling settings as validation built them (once; `params` adds the bound
    #: constraint). None until then.
    sampling: SamplingParams | None = None
    #: ``tokentrail.vote`` ("confidence", "majority" or None) and ``tokentrail.early_stop``
    #: (`tokentrail.server.voting`).
    vote: str | None = None
    early_stop: bool = False
    #: ``echo`` (completions): the prompt before the completion; `echoed` is the prompt
    #: as echoed (`tokentrail.server.echo.Echo`), set when the request is prepared.
    echo: bool = False
    echoed: Any = None
    #: vLLM's extra fields (`tokentrail.server.vllm_fields`): the end tokens do not
    #: end the reply; ids that do; special tokens' text kept; ids listed in the reply.
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    #: How a chat prompt is rendered: the template's variables (`chat_template_kwargs`,
    #: `add_generation_prompt`, `continue_final_message`), for `prompting.prompt_ids`;
    #: a text prompt's `add_special_tokens` (None: the tokenizer's rule).
    template: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    #: The prompt's ids, kept when the reply lists them (`return_token_ids`).
    prompt_ids: tuple[int, ...] | None = None
    #: The prompt's logprobs asked of an upstream before the request joined the batch
    #: (`server.echo.fetch_prompt_rows`): (ids, rows or None, why not).
    fetched_rows: tuple[tuple[int, ...], Any, str | None] | None = None

    @property
    def prompt_only(self) -> bool:
        """``echo`` with `max_tokens` 0: the prompt returned (with its logprobs where
        asked) and nothing generated; its choices end with "length"."""
        return self.echo and self.max_tokens == 0

    @property
    def needs_logprobs(self) -> bool:
        """Whether the reply needs its tokens' logprobs: the client asked for them, or
        for a structure whose figures read them (a constraint, its fields, processed
        logprobs, tools, an action on confidence). Without, an upstream is asked for token ids only
        (`SamplingParams.logprobs`), and the extension's logprobs and confidence are
        null, as the OpenAI fields are."""
        s = self.structure
        return (
            self.logprobs
            or self.top_logprobs > 0
            or s.constraint is not None
            or s.fields
            or s.logprobs_mode != "raw"
            or bool(self.tools)
            or s.alarm is not None  # the actions read the confidence (issue #31)
            or s.retry is not None
            or s.branch is not None
            or self.vote is not None
        )

    def params(
        self, vocab_size: int | None = None, constraint: Any = None
    ) -> SamplingParams:
        """The sampling settings, checked by `make_params` against OpenAI's limits
        (`SamplingError` naming the wire field); `vocab_size` bounds `logit_bias`;
        `constraint` is `structure.constraint` bound to the model's tokenizer. Built
        once, when the request is validated; later calls add the constraint to that."""
        if self.sampling is not None:
            if constraint is None:
                return self.sampling
            return replace(self.sampling, constraint=constraint)
        return make_params(
            constraint=constraint,
            logprobs_mode=self.structure.logprobs_mode,
            temp=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            top_logprobs=self.top_logprobs,
            logprobs=self.needs_logprobs,
            ignore_eos=self.ignore_eos,
            vocab_size=vocab_size,
            limits=OPENAI_LIMITS,
            labels=_CHAT_LABELS if self.kind == "chat" else _COMPLETION_LABELS,
        )


def _gen_request(
    wire: _Common, kind: Kind, prompt: Any, model: str, vocab_size: int, temperature: float
) -> GenRequest:
    wire.check_together()
    max_tokens = wire.max_tokens
    if isinstance(wire, ChatRequest) and wire.max_completion_tokens is not None:
        max_tokens = wire.max_completion_tokens
    if isinstance(wire, ChatRequest):
        logprobs, top = bool(wire.logprobs), wire.top_logprobs or 0
    else:
        logprobs, top = wire.logprobs is not None, wire.logprobs or 0
    req = GenRequest(
        kind=kind,
        prompt=prompt,
        model=model,
        n=wire.n or 1,
        stream=bool(wire.stream),
        include_usage=bool(wire.stream_options and wire.stream_options.include_usage),
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        max_tokens_given=max_tokens is not None,
        temperature=temperature if wire.temperature is None else wire.temperature,
        top_p=1.0 if wire.top_p is None else wire.top_p,
        top_k=0 if wire.top_k in (None, -1) else wire.top_k,  # -1 means off, as in vLLM
        min_p=0.0 if wire.min_p is None else wire.min_p,
        repetition_penalty=wire.repetition_penalty,
        presence_penalty=wire.presence_penalty or 0.0,
        frequency_penalty=wire.frequency_penalty or 0.0,
        seed=wire.seed,
        stop=list(wire.stop) if wire.stop else None,
        logit_bias=dict(wire.logit_bias) if wire.logit_bias else None,
        logprobs=logprobs,
        top_logprobs=top,
        structure=structure_of(wire, kind == "chat"),
    )
    vllm_extras(wire, req, vocab_size)
    llamacpp_extras(wire, req, max_n=MAX_N, max_tokens=MAX_TOKENS_LIMIT)
    mlx_extras(wire, req)
    if wire.tokentrail is not None:
        check_vote(wire.tokentrail.vote, wire.tokentrail.early_stop, req.n)
        req.vote, req.early_stop = wire.tokentrail.vote, bool(wire.tokentrail.early_stop)
    if isinstance(wire, ChatRequest):
        req.structure = with_tools(req.structure, wire.tools, wire.tool_choice)
        req.tools = [t.as_template() for t in wire.tools] if wire.tools else None
    try:
        req.sampling = req.params(vocab_size)
        req.logit_bias = dict(req.sampling.logit_bias or {}) or None
    except SamplingError as e:
        raise bad_request(e.param, f"'{e.param}' {str(e).removeprefix(e.param).strip()}") from None
    if top and not logprobs:
        raise bad_request("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
    return req


def parse_chat(
    body: Mapping[str, Any], model: str, vocab_size: int, temperature: float = 0.0
) -> GenRequest:
    """Validate a /v1/chat/completions body (`temperature`: the default when it has none)."""
    try:
        wire = ChatRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    prompt = template_messages([m.as_prompt() for m in wire.messages])
    return _gen_request(wire, "chat", prompt, model, vocab_size, temperature)


def parse_completion(
    body: Mapping[str, Any], model: str, vocab_size: int, temperature: float = 0.0
) -> GenRequest:
    """Validate a /v1/completions body (`temperature`: the default when it has none)."""
    try:
        wire = CompletionRequest.model_validate(body, context={"vocab_size": vocab_size})
    except ValidationError as e:
        raise validation_error(e) from None
    if wire.max_tokens == 0:
        if not wire.echo:
            raise bad_request(
                "max_tokens",
                "'max_tokens' must be at least 1; 0 is for 'echo' alone (the prompt "
                "returned, scored where 'logprobs' is set, nothing generated)",
            )
        if wire.tokentrail is not None and wire.tokentrail.vote is not None:
            raise bad_request(
                "tokentrail.vote", "'tokentrail.vote' needs completions to vote on; "
                "'max_tokens' 0 makes none",
            )  # fmt: skip
    req = _gen_request(wire, "completion", wire.prompt, model, vocab_size, temperature)
    req.echo = bool(wire.echo)
    return req
