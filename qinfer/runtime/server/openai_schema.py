"""Request bodies of the OpenAI completions and chat API (the fields we honour), and the plain transcript a chat
becomes where the model has no chat template."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from qinfer.runtime.engine.chat_template import ChatTemplate
from qinfer.runtime.engine.sampling import SamplingParams

# Base models (the synth and ReLU ones) have no chat template: their chat turns are a plain transcript.
CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
CHAT_STOP = "\nUser:"
# Each stop string is searched for after every token, so their number and length bound a request's cost.
MAX_STOPS = 16
MAX_STOP_CHARS = 256
# What torch.Generator.manual_seed takes.
MAX_SEED = 2**64 - 1


def _valid_unicode(value: str | list[str]) -> str | list[str]:
    """Refuse lone surrogates: JSON's \\ud800 escapes can carry them, and no tokenizer can encode them."""
    for text in [value] if isinstance(value, str) else value:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "unicode",
                "not valid Unicode: a lone surrogate {char} at character {at}",
                {"char": f"\\u{ord(text[exc.start]):04x}", "at": exc.start},
            ) from None
    return value


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON valid under a schema (always strict here:
    the grammar admits nothing else)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    # Unknown fields (logit_bias, user, ...) are accepted and ignored, as lenient OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # NaN is refused as not finite, rather than as over the bound it fails to compare with.
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    # Not in OpenAI's API; llama.cpp's server takes the same two.
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    n: Literal[1] = 1
    stream: bool = False
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    # Token log-probabilities are not computed: a request that asks for them is refused, not answered without them.
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, value: bool | int | None) -> None:
        # Legacy completions read logprobs=0 as "the chosen tokens' log-probabilities": only None and false are
        # requests for none.
        if value is not None and value is not False:
            raise PydanticCustomError("unsupported", "log-probabilities are not supported; leave the field out")
        return None

    @field_validator("stop")
    @classmethod
    def _capped_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = _as_list(stop)
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise PydanticCustomError(
                "stop_limits",
                "at most {count} stop strings of at most {chars} characters each",
                {"count": MAX_STOPS, "chars": MAX_STOP_CHARS},
            )
        return stop

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def stop_list(self) -> list[str]:
        return _as_list(self.stop)


class CompletionRequest(SamplingFields):
    # An empty prompt is a model's BOS token alone, as OpenAI and vLLM take it (submit refuses one without a BOS).
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)

    _valid_prompt = field_validator("prompt")(_valid_unicode)

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("one prompt per request: send a list of exactly one string")
        return self.prompt[0]


# The kinds of content part that carry text, and the field that holds it.
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def _no_such_part(kind: str) -> PydanticCustomError:
    return PydanticCustomError(
        "content_part",
        'content parts must be text, {"type": "text", "text": "..."}; this server reads no {kind} part',
        {"kind": kind},
    )


class ChatMessage(BaseModel):
    # A tool's answer (role "tool") and an assistant's earlier tool calls travel as templates expect them.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None

    _valid_content = field_validator("content")(lambda v: v if v is None else _valid_unicode(v))

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: object) -> object:
        """OpenAI's list form of content (what its SDKs send for parts), as the text templates expect: its text
        parts joined by newlines, as vLLM joins them, an assistant's refusal part read as its text. A part of another
        kind (an image) is refused: the models served here read text alone."""
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict):
                raise _no_such_part(type(part).__name__)
            kind = part.get("type")
            field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
            if field is None:
                raise _no_such_part(repr(kind) if kind is not None else "untyped")
            text = part.get(field)
            if not isinstance(text, str):
                raise PydanticCustomError(
                    "content_part", "a {kind} part needs its text as a string in {field}",
                    {"kind": repr(kind), "field": repr(field)},
                )  # fmt: skip
            texts.append(text)
        return "\n".join(texts)


class ToolFunction(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: ToolFunction


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def template_inputs(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools as a chat template sees them (plain dicts, as transformers passes them)."""
        tools = [t.model_dump() for t in self.tools] if self.tools and self.tool_choice != "none" else None
        return [m.model_dump(exclude_none=True) for m in self.messages], tools

    def forced_tools(self) -> list[Tool]:
        """The tools the answer must call one of: all of them for "required", the named one, none otherwise."""
        if self.tool_choice in (None, "none", "auto"):
            return []
        if not self.tools:
            raise ValueError("tool_choice asks for a tool call, but the request gives no tools")
        if self.tool_choice == "required":
            return self.tools
        assert isinstance(self.tool_choice, NamedToolChoice)
        name = self.tool_choice.function.get("name")
        named = [t for t in self.tools if t.function.name == name]
        if not named:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return named

    def chat_stops(self, template: ChatTemplate | None) -> list[str]:
        """The request's stops; a plain transcript also ends before the next user turn (a template's turn ends
        with its own end-of-turn token)."""
        return self.stop_list() if template is not None else [*self.stop_list(), CHAT_STOP]


class TokenizeRequest(BaseModel):
    """llama.cpp's /tokenize: the ids of `content`, with BOS where the model adds one if `add_special`."""

    content: str
    add_special: bool = False

    _valid_content = field_validator("content")(_valid_unicode)


class DetokenizeRequest(BaseModel):
    tokens: list[int] = Field(max_length=1 << 20)


def tool_call_schema(tools: list[Tool]) -> dict[str, Any]:
    """A call of one of `tools`: {"name": ..., "arguments": {...}} with the arguments its parameters describe."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def chat_prompt(messages: list[ChatMessage]) -> str:
    """ "System: ...\\nUser: ...\\nAssistant: ...\\n" for each turn, then "Assistant:" for the model to continue."""
    turns = [f"{CHAT_ROLES[m.role]}: {m.content or ''}" for m in messages]
    return "\n".join([*turns, "Assistant:"])
