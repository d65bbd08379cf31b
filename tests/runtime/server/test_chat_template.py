"""Chat templates: the GGUF carries the checkpoint's, the server renders it in a sandbox, and the ids equal
transformers' `apply_chat_template` for the templates of Llama-3, Mistral and Qwen2 instruct models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from qinfer.core.errors import UserError
from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.swiglu import build_swiglu
from qinfer.runtime.engine.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    read_chat_template,
)
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.model.model_file import open_model
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello there! Who are you?"}],
    [
        {"role": "user", "content": "  Write def f(x): return x ** 2  "},
        {"role": "assistant", "content": "Here it is: 東京 🙂"},
        {"role": "user", "content": "Thanks.\n\nAnd 12345?"},
    ],
]
SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2"])
def instruct(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    family = str(request.param)
    out = tmp_path_factory.mktemp(f"instruct-{family}")
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    model = build_swiglu(out / "model", family, chat_template=template)
    gguf = convert(model, out / "m.gguf", None, "f32").outfile
    return {"family": family, "model": model, "gguf": gguf, "template": template}


def conversations(family: str) -> list[list[dict[str, str]]]:
    # Mistral's template takes no system turn; the others get one too.
    return CONVERSATIONS if family == "mistral" else [*CONVERSATIONS, [SYSTEM, *CONVERSATIONS[1]]]


def hf_chat_ids(model: Path, messages: list[dict[str, str]]) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_ids_equal_apply_chat_template(instruct: dict[str, Any]) -> None:
    meta = open_model(instruct["gguf"]).metadata
    assert meta["tokenizer.chat_template"] == instruct["template"]
    tokenizer = GGUFTokenizer(meta)
    template = load_chat_template(tokenizer.chat_template, tokenizer.special_tokens)
    assert template is not None
    for messages in conversations(instruct["family"]):
        ours = tokenizer.encode(template.render(messages), add_bos=False)
        assert ours == hf_chat_ids(instruct["model"], messages), messages


def test_the_server_renders_the_models_template(instruct: dict[str, Any]) -> None:
    """The OpenAI client's chat call: the prompt the server counts is the template's, and a turn the template
    refuses (Mistral's takes no system message) is a 400 with the template's own words."""
    engine = Engine.open(instruct["gguf"], slots=1, ctx_size=128)
    tokenizer = engine.tokenizer
    template = load_chat_template(tokenizer.chat_template, tokenizer.special_tokens)
    with serve_in_thread(create_app(EngineWorker(engine), "m", chat_template=template)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        messages = CONVERSATIONS[1]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.prompt_tokens == len(hf_chat_ids(instruct["model"], messages))
        if instruct["family"] == "mistral":
            with pytest.raises(openai.BadRequestError, match="roles must alternate"):
                client.chat.completions.create(model="m", messages=[SYSTEM, *messages], max_tokens=4)  # type: ignore[list-item]


def test_the_sandbox_keeps_python_out(tmp_path: Path) -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ChatTemplateError, match="refused"):
        template.render([{"role": "user", "content": "hi"}])
    with pytest.raises(UserError, match="does not parse"):
        ChatTemplate("{% for %}", {})
    # A template's own bug on some messages (an assistant turn with no content) is the request's error, not a crash.
    buggy = ChatTemplate("{% for m in messages %}{{ m.content + '<|end|>' }}{% endfor %}", {})
    with pytest.raises(ChatTemplateError, match="failed on these messages .TypeError"):
        buggy.render([{"role": "assistant", "content": None}])
    override = tmp_path / "t.jinja"
    override.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ bos_token }}")
    chosen = load_chat_template("ignored", {"bos_token": "<s>"}, read_chat_template(override))
    assert chosen is not None and chosen.render([{"role": "user", "content": "hi"}]) == "<user>hi<s>"
    assert load_chat_template(None, {}) is None
    with pytest.raises(UserError, match="cannot read"):
        read_chat_template(tmp_path / "missing.jinja")
    override.write_text("{% for %}")
    with pytest.raises(UserError, match="does not parse"):
        read_chat_template(override)
