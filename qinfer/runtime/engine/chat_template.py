"""Chat turns rendered with the model's own Jinja chat template, as transformers' `apply_chat_template` renders
them, in jinja2's sandbox: a template comes from a file off the internet and must not reach Python's internals.

The template is the GGUF's `tokenizer.chat_template` (llama.cpp's key, which converters copy from the checkpoint's
tokenizer config), or a file given with `--chat-template`. It sees what transformers passes: `messages`,
`add_generation_prompt`, `tools`, and the special tokens' texts (`bos_token`, `eos_token`, ...); the rendered text
already holds the BOS a model wants, so it is tokenized without adding another.
"""

from __future__ import annotations

import functools
import json
import stat
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qinfer.core.errors import UserError

MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KiB; tool-calling ones up to some tens


class ChatTemplateError(UserError):
    """The template refused the conversation (its own raise_exception) or broke while rendering it."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' own tojson: jinja2's escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    # Intercepted, jinja2 neither folds these on constants while it compiles nor computes them but through the
    # sandbox's call: `'x' * 10**10` is then computed when the template renders (in the process that
    # template_process.py limits), not when it loads.
    env.intercepted_binops = frozenset({"*", "**", "%", "//"})
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A template checked when the server starts and compiled where it first renders (jinja2 evaluates constant
    expressions while compiling, so a hostile template's compile belongs with its renders, in a limited process)."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens  # bos_token, eos_token, ...: the texts of the model's special tokens
        if len(source) > MAX_TEMPLATE_BYTES:
            raise UserError(f"the chat template is over {MAX_TEMPLATE_BYTES >> 10} KiB; give one with --chat-template")
        try:
            _environment().parse(source)
        except jinja2.TemplateSyntaxError as exc:
            raise UserError(f"the chat template does not parse (line {exc.lineno}: {exc.message})") from None
        except RecursionError:
            raise UserError("the chat template nests too deeply to parse; give one with --chat-template") from None

    @functools.cached_property
    def compiled(self) -> jinja2.Template:
        return _environment().from_string(self.source)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[Any] | None = None
    ) -> str:
        try:
            return self.compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **self.special_tokens
            )
        except jinja2.TemplateError as exc:  # the sandbox's SecurityError is one too
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template's own bug (None + "x", a missing field) on these messages
            reason = f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(f"the chat template failed on these messages ({reason})") from None


def read_chat_template(path: Path) -> str:
    """The text of a template file (`--chat-template`), checked to parse: a command reads it before the model
    loads, so that a wrong path costs no load."""
    try:
        # A pipe would block the read, and a device such as /dev/zero never end it.
        if not stat.S_ISREG(path.stat().st_mode):
            raise UserError(f"the chat template {path} is not a regular file; give a template file")
        with path.open("rb") as file:
            data = file.read(MAX_TEMPLATE_BYTES + 1)
        if len(data) > MAX_TEMPLATE_BYTES:
            raise UserError(f"{path} is over {MAX_TEMPLATE_BYTES >> 10} KiB; is it a chat template?")
        source = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the chat template {path} ({exc})") from None
    ChatTemplate(source, {})
    return source


def load_chat_template(
    own: str | None, special_tokens: dict[str, str], override: str | None = None
) -> ChatTemplate | None:
    """The template `override` (a file's text: `read_chat_template`), else the model file's own (`own`); None
    where there is neither."""
    if override is not None:
        return ChatTemplate(override, special_tokens)
    if own is None or not own.strip():
        return None
    return ChatTemplate(own, special_tokens)
