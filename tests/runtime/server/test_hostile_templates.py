"""Chat templates an attacker would ship in a GGUF, or a broken environment would pass as --chat-template: loops for
hours, gigabytes of output, runaway recursion, a pipe or a device for a file. Each ends in one line within its
deadline, the process that rendered it is replaced, and the server answers /health meanwhile."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qinfer.core.errors import UserError
from qinfer.runtime.engine.chat_template import ChatTemplate, ChatTemplateError, read_chat_template
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server import template_process
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.template_process import TemplateProcess
from qinfer.runtime.server.thread import serve_in_thread
from tests.runtime.server.test_server import CTX
from tests.runtime.server.test_server_hardening import _call

DEADLINE_S = 1.5
FREEZE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Each would otherwise run for minutes, take gigabytes, or both; guarded by what the content says.
HOSTILE = {
    "nested loops": FREEZE,
    "string product": "{{ 'x' * 10 ** 10 }}",
    "huge power": "{{ 3 ** 999999999 }}",
    "tojson indent": "{{ messages | tojson(indent=10 ** 9) }}",
    "lipsum": "{{ lipsum(10 ** 7) }}",
    "strftime format": "{{ strftime_now('%Y' * 10 ** 9) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s | length }}",
}
MESSAGES = [{"role": "user", "content": "Hello"}]


def guarded(body: str) -> ChatTemplate:
    """A template that renders the conversation unless the first message says "attack"."""
    return ChatTemplate(
        f"{{% if messages[0].content == 'attack' %}}{body}{{% endif %}}{{{{ messages[0].content }}}}", {}
    )


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_template_fails_within_its_deadline_and_the_next_render_works(name: str) -> None:
    renderer = TemplateProcess(guarded(HOSTILE[name]), timeout_s=DEADLINE_S)
    try:
        started = time.monotonic()
        with pytest.raises(ChatTemplateError, match="chat template"):
            renderer.render([{"role": "user", "content": "attack"}])
        assert time.monotonic() - started < DEADLINE_S + 15  # the deadline, and a fresh process's start
        assert renderer.render(MESSAGES) == "Hello"
    finally:
        renderer.close()


def test_compiling_a_template_computes_none_of_its_constants() -> None:
    """jinja2 folds constant expressions while it compiles: not these, which must wait for a limited render. Checked
    in a process of its own with 1 GiB of address space, so that a regression fails here instead of taking the
    machine's memory."""
    script = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "from qinfer.runtime.engine.chat_template import ChatTemplate\n"
        f"for body in {[HOSTILE[name] for name in ('string product', 'huge power')]!r}:\n"
        "    ChatTemplate(body, {}).compiled\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_renders_equal_the_templates_own() -> None:
    template = ChatTemplate(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
        {"bos_token": "<s>"},
    )
    renderer = TemplateProcess(template)
    try:
        messages = [{"role": "user", "content": "東京 🙂"}, {"role": "assistant", "content": "a\nb"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        for args in ((messages, True, None), (messages, False, tools)):
            assert renderer.render(*args) == template.render(*args)
    finally:
        renderer.close()


def test_health_answers_while_a_template_freezes(gguf_files: dict[str, Path]) -> None:
    engine = Engine.open(gguf_files["pi-f32"], slots=1, ctx_size=CTX)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny", chat_template=guarded(FREEZE))) as url:
        body = {"messages": [{"role": "user", "content": "attack"}], "max_tokens": 1}
        answers: list[tuple[int, dict[str, object]]] = []
        attack = threading.Thread(target=lambda: answers.append(_call(f"{url}/v1/chat/completions", body)[:2]))
        attack.start()
        time.sleep(0.3)
        while attack.is_alive():
            started = time.monotonic()
            assert _call(f"{url}/health")[0] == 200 and time.monotonic() - started < 1.0
            time.sleep(0.1)
        status, answer = answers[0]
        assert status == 400 and "took over" in str(answer)
        fine = {"messages": MESSAGES, "max_tokens": 1, "ignore_eos": True}
        assert _call(f"{url}/v1/chat/completions", fine)[0] == 200


def test_a_template_file_that_is_a_pipe_or_a_device_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "template.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        outcome: list[BaseException] = []
        reader = threading.Thread(target=lambda p=path, o=outcome: o.append(_refusal(p)), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), f"reading {path} blocked"
        assert isinstance(outcome[0], UserError) and "not a regular file" in str(outcome[0])


def _refusal(path: Path) -> BaseException:
    try:
        read_chat_template(path)
    except UserError as exc:
        return exc
    raise AssertionError(f"{path} was read as a template")


def test_renders_queue_on_their_own_thread_and_only_so_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hostile chat requests arriving together: past MAX_WAITING they are refused at once, and the threads that
    tokenize every other request stay free meanwhile."""
    monkeypatch.setattr(template_process, "MAX_WAITING", 2)
    renderer = TemplateProcess(guarded(FREEZE), timeout_s=0.5)
    attack = [{"role": "user", "content": "attack"}]

    async def main() -> list[object]:
        renders = [asyncio.create_task(renderer.render_async(attack)) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 1.0) == "free"
        return await asyncio.gather(*renders, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        renderer.close()
    assert [type(o).__name__ for o in outcomes] == ["ChatTemplateError"] * 3 + ["RendererBusy"] * 2
    with pytest.raises(ChatTemplateError, match="shutting down"):
        renderer.render(MESSAGES)
