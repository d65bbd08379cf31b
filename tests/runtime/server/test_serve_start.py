"""What `qinfer serve` settles before the model loads (a load takes minutes for a large model): the address it
listens on and the chat template file; and the options it hands the load."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from qinfer.core.errors import UserError
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.server.thread import listening_sockets, url_of
from tests.support.cli_in_process import run_in_process
from tests.support.ports import free_port


class Loaded(Exception):
    """Raised in place of loading the model: the command got as far as the load."""


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Engine.open replaced by a recorder that stops the command; the options it was given."""
    given: dict[str, object] = {}

    def record(_model: Path, **options: object) -> Engine:
        given.update(options)
        raise Loaded

    monkeypatch.setattr(Engine, "open", record)
    return given


def test_an_address_in_use_is_refused_in_one_line_before_the_load(
    gguf_files: dict[str, Path], no_load: dict[str, object]
) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        result = run_in_process("serve", "-m", str(gguf_files["pi-f16"]), "--port", str(port))
    assert result.returncode == 2 and not no_load, result.stderr
    assert result.stderr == f"error: cannot listen on 127.0.0.1:{port} (Address already in use); choose another " \
        "--host or --port\n"  # fmt: skip


def test_a_chat_template_file_is_read_before_the_load(
    gguf_files: dict[str, Path], no_load: dict[str, object], tmp_path: Path
) -> None:
    model = str(gguf_files["pi-f16"])
    missing = tmp_path / "missing.jinja"
    result = run_in_process("serve", "-m", model, "--port", str(free_port()), "--chat-template", str(missing))
    assert result.returncode == 2 and not no_load
    assert (
        result.stderr.startswith(f"error: cannot read the chat template {missing}") and result.stderr.count("\n") == 1
    )
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    result = run_in_process("serve", "-m", model, "--port", str(free_port()), "--chat-template", str(broken))
    assert result.returncode == 2 and not no_load and "does not parse" in result.stderr


def test_every_address_of_the_host_listens_and_an_ipv6_one_takes_ipv6_alone() -> None:
    """As asyncio's own server would listen: "" on IPv4 and IPv6 with one port, and "::" not on IPv4 too, which
    would open the server to more of the network than asked."""
    has_ipv6 = socket.has_ipv6 and Path("/proc/net/if_inet6").exists()
    with listening_sockets("", 0) as sockets:
        families = {s.family: s.getsockname()[1] for s in sockets}
        assert socket.AF_INET in families and len(set(families.values())) == 1
        assert (socket.AF_INET6 in families) == has_ipv6
    if not has_ipv6:
        pytest.skip("this machine has no IPv6")
    with listening_sockets("::", 0) as sockets:
        assert [s.family for s in sockets] == [socket.AF_INET6]
        assert sockets[0].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        assert url_of("::", sockets[0]) == f"http://[::]:{sockets[0].getsockname()[1]}"


def test_a_bound_socket_that_does_not_listen_still_holds_the_port() -> None:
    """Two sockets with SO_REUSEADDR may both bind a port nobody listens on: a second server started while the first
    loads its model would bind, load, and fail only when uvicorn listens. The first one listens from the start."""
    with listening_sockets("127.0.0.1", 0) as first:
        port = first[0].getsockname()[1]
        refused = pytest.raises(UserError, match=f"cannot listen on 127.0.0.1:{port} .Address already in use.")
        with refused, listening_sockets("127.0.0.1", port):
            pass


def test_serve_can_replan_a_stale_gpuidx(gguf_files: dict[str, Path], no_load: dict[str, object]) -> None:
    """A plan made for one sequence (`make all`, `qinfer plan`) is stale for a server's slots: `serve` takes
    --reset-gpu-index, as its refusal says."""
    model = str(gguf_files["pi-f16"])
    with pytest.raises(Loaded):
        run_in_process("serve", "-m", model, "--port", str(free_port()), "--vram-budget", "1", "--reset-gpu-index")
    assert no_load["reset_gpu_index"] is True and no_load["slots"] == 4
