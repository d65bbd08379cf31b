"""Request bodies of the OpenAI completions and chat API (the fields we honour), and the chat prompt template."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qinfer_runtime.sampling import SamplingParams

# The synth and ReLU base models have no chat template, so chat turns are rendered as a plain transcript.
CHAT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOP = "\nUser:"


class SamplingFields(BaseModel):
    # Unknown fields (logit_bias, user, ...) are accepted and ignored, as lenient OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # Not in OpenAI's API; llama.cpp's server takes the same two.
    top_k: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    n: Literal[1] = 1
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("one prompt per request: send a list of exactly one string")
        return self.prompt[0]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)

    def prompt_text(self) -> str:
        return chat_prompt(self.messages)

    def stop_list(self) -> list[str]:
        return [*super().stop_list(), CHAT_STOP]


def chat_prompt(messages: list[ChatMessage]) -> str:
    """ "System: ...\\nUser: ...\\nAssistant: ...\\n" for each turn, then "Assistant:" for the model to continue."""
    turns = [f"{CHAT_ROLES[m.role]}: {m.content}" for m in messages]
    return "\n".join([*turns, "Assistant:"])
