"""`qinfer prep download` against a hub-shaped HTTP server on 127.0.0.1 and a hand-made hub cache: never the network.

The CLI runs in a subprocess because huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE at import.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qinfer.prep.hub.model_profiles import load_model_profile
from tests.support.ports import free_port

MODEL = "ReluLLaMA-7B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# The hub client backs off for about 25 s before it gives up on a refused connection; the test skips the waiting.
NO_BACKOFF = "import time; time.sleep = lambda seconds: None; "


@dataclass
class FakeHub:
    """Serves `files` under /{repo}/resolve/{revision}/{name} as the hub does (HEAD metadata, GET with Range)."""

    files: dict[str, dict[str, bytes]]
    gated: set[str] = field(default_factory=set)
    cut_once: set[str] = field(default_factory=set)
    ranges: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _lookup(self) -> tuple[str, bytes] | None:
            repo, sep, rest = self.path.lstrip("/").partition("/resolve/")
            name = rest.partition("/")[2]
            if not sep:
                self._error(404, "EntryNotFound")
                return None
            if repo in hub.gated:
                self._error(403, "GatedRepo")
                return None
            if repo not in hub.files:
                self._error(401, "RepoNotFound")
                return None
            if name not in hub.files[repo]:
                self._error(404, "EntryNotFound")
                return None
            return name, hub.files[repo][name]

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _meta(self, data: bytes) -> None:
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")

        def do_HEAD(self) -> None:
            found = self._lookup()
            if found:
                self.send_response(200)
                self._meta(found[1])
                self.send_header("Content-Length", str(len(found[1])))
                self.end_headers()

        def do_GET(self) -> None:
            found = self._lookup()
            if not found:
                return
            name, data = found
            start = 0
            if "Range" in self.headers:
                hub.ranges.append((name, self.headers["Range"]))
                start = int(self.headers["Range"].removeprefix("bytes=").partition("-")[0])
            self.send_response(206 if start else 200)
            self._meta(data)
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if name in hub.cut_once:
                # The connection drops half-way through the body, as a flaky network does.
                hub.cut_once.discard(name)
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    profile = load_model_profile(MODEL)
    assert profile.gguf_f16 is not None
    # Larger than huggingface_hub's 10 MB download chunk: a cut inside the first chunk would resume from byte 0.
    files = {profile.gguf_f16: os.urandom(24 << 20)}
    files |= {name: f"counts of layer {name}".encode() for name in profile.activation_files}
    fake = FakeHub({profile.gguf_repo: files})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()


def _run(
    args: list[str], cache: Path, endpoint: str, offline: bool = False, prelude: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", "NO_COLOR": "1"}
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-c", f"{prelude}from qinfer.cli.main import main; main()", "prep", "download", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_download_lays_out_the_repo_and_resumes_after_a_cut(hub: FakeHub, tmp_path: Path) -> None:
    profile = load_model_profile(MODEL)
    repo = hub.files[profile.gguf_repo]
    model_name = profile.gguf_f16
    assert model_name is not None
    hub.cut_once.add(model_name)
    endpoint = f"http://127.0.0.1:{hub.port}"
    out = tmp_path / "m"

    done = _run([MODEL, "--dir", str(out)], tmp_path / "cache", endpoint)

    assert done.returncode == 0, done.stderr
    assert (out / model_name).read_bytes() == repo[model_name]
    # One retry, asking only for what the cut left out.
    assert len(hub.ranges) == 1 and hub.ranges[0][0] == model_name
    start = int(hub.ranges[0][1].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= len(repo[model_name]) // 2
    for i in range(profile.spec.layers):
        assert (out / "activation" / f"activation_{i}.pt").read_bytes() == repo[f"activation/activation_{i}.pt"]
    assert sorted(p.name for p in out.iterdir()) == sorted([model_name, "activation"])
    # The layout shares the cache's blob rather than holding a second copy.
    blobs = list((tmp_path / "cache").glob("models--*/blobs/*"))
    assert any(os.path.samefile(b, out / model_name) for b in blobs)


def test_offline_uses_the_cache_and_says_what_is_missing(hub: FakeHub, tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{hub.port}"
    cache = tmp_path / "cache"
    empty = _run([MODEL, "--dir", str(tmp_path / "a")], cache, endpoint, offline=True)
    assert empty.returncode == 2
    assert "HF_HUB_OFFLINE is set" in empty.stderr and "Traceback" not in empty.stderr

    assert _run([MODEL, "--dir", str(tmp_path / "a")], cache, endpoint).returncode == 0
    hub.files.clear()  # the server now knows nothing: only the cache can answer
    again = _run([MODEL, "--dir", str(tmp_path / "b")], cache, endpoint, offline=True)
    assert again.returncode == 0, again.stderr
    assert (
        tmp_path / "b" / "activation" / "activation_31.pt"
    ).read_bytes() == b"counts of layer activation/activation_31.pt"


def test_gated_unknown_and_unreachable_are_one_line_errors(hub: FakeHub, tmp_path: Path) -> None:
    profile = load_model_profile(MODEL)
    hub.gated.add(profile.gguf_repo)
    gated = _run([MODEL, "--dir", str(tmp_path / "g")], tmp_path / "cache", f"http://127.0.0.1:{hub.port}")
    assert gated.returncode == 2 and "is gated" in gated.stderr and "HF_TOKEN" in gated.stderr

    hub.gated.clear()
    private = hub.files.pop(profile.gguf_repo)
    hidden = _run([MODEL, "--dir", str(tmp_path / "p")], tmp_path / "cache", f"http://127.0.0.1:{hub.port}")
    assert hidden.returncode == 2 and "not found" in hidden.stderr and "HF_TOKEN" in hidden.stderr
    hub.files[profile.gguf_repo] = private

    unknown = _run(["NoSuchModel-7B"], tmp_path / "cache", f"http://127.0.0.1:{hub.port}")
    assert unknown.returncode == 2 and "known models:" in unknown.stderr and "ReluLLaMA-7B" in unknown.stderr

    # A port nothing listens on stands in for a machine without network.
    closed = free_port()
    offline = _run(
        [MODEL, "--dir", str(tmp_path / "n")], tmp_path / "cache", f"http://127.0.0.1:{closed}", prelude=NO_BACKOFF
    )
    assert offline.returncode == 2 and "cannot reach" in offline.stderr
    for result in (gated, hidden, unknown, offline):
        assert result.stderr.count("error:") == 1 and "Traceback" not in result.stderr


def test_unpublished_variant_points_to_the_originals(tmp_path: Path) -> None:
    from qinfer.core.errors import UserError
    from qinfer.prep.hub.download import download

    with pytest.raises(UserError, match="no f16 PowerInfer GGUF.*--source original"):
        download(load_model_profile("ReluFalcon-40B"), tmp_path, "gguf", "f16")


def _cache_repo(cache: Path, repo: str, files: dict[str, bytes]) -> None:
    """Lay `files` out as huggingface_hub's cache does: blobs by hash, a snapshot of symlinks, refs/main."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / COMMIT / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


def test_original_source_from_a_prepopulated_cache_offline(tmp_path: Path) -> None:
    profile = load_model_profile(MODEL)
    cache = tmp_path / "cache"
    checkpoint = {"config.json": b'{"model_type": "llama"}', "tokenizer.model": b"spm", "model.safetensors": b"w"}
    predictor = {f"model_{i}.pt": f"predictor {i}".encode() for i in range(profile.spec.layers)}
    _cache_repo(cache, profile.original_repo, checkpoint)
    _cache_repo(cache, profile.predictor_repo, predictor)
    _cache_repo(cache, profile.gguf_repo, {name: name.encode() for name in profile.activation_files})
    out = tmp_path / "m"

    done = _run([MODEL, "--source", "original", "--dir", str(out)], cache, "http://127.0.0.1:9", offline=True)

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out / "model")
    assert {p.name: p.read_bytes() for p in (out / "model").iterdir()} == checkpoint
    assert {p.name: p.read_bytes() for p in (out / "predictor").iterdir()} == predictor
    assert (out / "activation" / "activation_7.pt").read_bytes() == b"activation/activation_7.pt"


def test_a_target_the_layout_cannot_take_is_refused_before_any_fetch(tmp_path: Path) -> None:
    """No hub answers here: a download that went as far as fetching would say it cannot reach one instead."""
    profile = load_model_profile(MODEL)
    assert profile.gguf_f16 is not None
    nowhere = f"http://127.0.0.1:{free_port()}"
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    blocked = tmp_path / "blocked"
    (blocked / profile.gguf_f16).mkdir(parents=True)
    cases = {
        str(a_file): "as a directory (File exists); name another --dir",
        str(a_file / "below"): "as a directory (Not a directory); name another --dir",
        str(blocked): "is a directory where the download puts a file",
    }
    for target, words in cases.items():
        done = _run([MODEL, "--dir", target], tmp_path / "cache", nowhere, prelude=NO_BACKOFF)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and words in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
    assert sorted(p.name for p in blocked.iterdir()) == [profile.gguf_f16]
    # A download refused for what it asks (an unpublished variant) makes no directory.
    unpublished = tmp_path / "unpublished"
    done = _run(["ReluFalcon-40B", "--variant", "f16", "--dir", str(unpublished)], tmp_path / "cache", nowhere)
    assert done.returncode == 2 and "--source original" in done.stderr and not unpublished.exists()
