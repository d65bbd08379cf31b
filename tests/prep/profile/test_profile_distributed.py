"""`prep profile --distributed`: two gloo processes under torchrun write exactly the files one process writes, each
resumes from its own checkpoint, and without torchrun's environment the command fails in one line. Every process
talks over the loopback interface only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.prep.profile.activation_profile import profile_activations, state_file, torchrun_shard
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.prep.synth.moe import build_moe
from tests.support.cli_in_process import run_in_process
from tests.support.ports import free_port

TOKENS, SEQ_LEN, BATCH = 3000, 64, 2  # 47 windows in 24 batches, the last window short
OPTIONS = ["--tokens", str(TOKENS), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--device", "cpu"]
# A worker of a distributed run, started without torchrun, that stops itself once the walk reaches `stop` windows.
STOPPING_WORKER = """
import os, sys
from pathlib import Path
from qinfer.core.errors import UserError
from qinfer.prep.profile.activation_profile import profile_activations, torchrun_shard
model, corpus, out, stop, tokens, seq_len, batch = sys.argv[1:]
def halt(_tokens, _wanted, windows):
    if windows >= int(stop):
        raise SystemExit(3)
profile_activations(Path(model), Path(corpus), Path(out), tokens=int(tokens), seq_len=int(seq_len),
    batch_size=int(batch), device="cpu", checkpoint_every=1, on_progress=halt, shard=torchrun_shard(os.environ))
"""


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun keeps its logs in a directory of its own under TMPDIR: one of pytest's, not the system's, which
    would keep them after every run."""
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("torchrun")))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "stories.txt"
    path.write_text(synth_corpus(5, 16_000, "calibrate"), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def single(tiny: SynthReport, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What one process writes, in the options the distributed runs use."""
    out = tmp_path_factory.mktemp("single")
    profile_activations(tiny.model_dir, corpus, out, tokens=TOKENS, seq_len=SEQ_LEN, batch_size=BATCH, device="cpu")
    return out


def loopback_env(**extra: str) -> dict[str, str]:
    """This environment with a free port on 127.0.0.1 for the processes to meet on, and gloo bound to loopback."""
    port = free_port()
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": loopback,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        **extra,
    }


def torchrun_profile(model_dir: Path, corpus: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = loopback_env()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--local-addr", "127.0.0.1"]
    command += ["--master-addr", "127.0.0.1", "--master-port", env["MASTER_PORT"]]
    command += ["-m", "qinfer", "prep", "profile", str(model_dir)]
    command += ["--data", str(corpus), "--out", str(out), *OPTIONS, "--distributed"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def layer_counts(directory: Path) -> torch.Tensor:
    return torch.stack([torch.load(directory / f"activation_{i}.pt", weights_only=True) for i in range(2)])


def test_two_processes_write_the_files_one_process_writes(
    tiny: SynthReport, corpus: Path, single: Path, tmp_path: Path
) -> None:
    done = torchrun_profile(tiny.model_dir, corpus, tmp_path)
    assert done.returncode == 0, done.stderr
    assert torch.equal(layer_counts(tmp_path), layer_counts(single))
    assert files(tmp_path) == files(single)  # the same bytes, summary.json and its token count included
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] == TOKENS
    assert done.stderr.count("layer 1: sparsity") == 1  # rank 0 alone reports


def test_two_processes_count_an_expert_model_as_one_does(corpus: Path, tmp_path: Path) -> None:
    model = build_moe(tmp_path / "model", "qwen2moe")
    single = tmp_path / "single"
    profile_activations(model, corpus, single, tokens=TOKENS, seq_len=SEQ_LEN, batch_size=BATCH, device="cpu")
    done = torchrun_profile(model, corpus, tmp_path / "two")
    assert done.returncode == 0, done.stderr
    assert files(tmp_path / "two") == files(single)
    assert json.loads((single / "summary.json").read_text())["unit"] == "expert"
    assert done.stderr.count("layer 1: the most-routed") == 1


def test_each_process_resumes_from_its_own_checkpoint(
    tiny: SynthReport, corpus: Path, single: Path, tmp_path: Path
) -> None:
    env = loopback_env(WORLD_SIZE="2")
    stops = {0: 8, 1: 16}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", STOPPING_WORKER, str(tiny.model_dir), str(corpus), str(tmp_path), str(stop)]
            + [str(TOKENS), str(SEQ_LEN), str(BATCH)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, stop in stops.items()
    ]
    for worker in workers:
        _, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 3, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".profile_state.rank0.pt", ".profile_state.rank1.pt"]

    # Rank 0 took batches 0 and 2 and stopped as it passed batch 3; rank 1 took batches 1, 3, 5 and 7, then stopped.
    ranks = [torch.load(tmp_path / f".profile_state.rank{r}.pt", weights_only=True) for r in stops]
    assert [(s["batches"], s["windows"], s["tokens"]) for s in ranks] == [(3, 6, 6 * SEQ_LEN), (8, 16, 16 * SEQ_LEN)]
    # A mark in rank 1's counts must reach the output once: rank 1 continued from its checkpoint, not from scratch.
    ranks[1]["counts"][1, 5] += 1000
    torch.save(ranks[1], tmp_path / ".profile_state.rank1.pt")

    done = torchrun_profile(tiny.model_dir, corpus, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "resumed after 6 windows" in done.stderr
    expected = layer_counts(single)
    expected[1, 5] += 1000
    assert torch.equal(layer_counts(tmp_path), expected)
    assert not list(tmp_path.glob(".profile_state*"))


def test_distributed_without_torchrun_is_one_line(
    tiny: SynthReport, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "activation"
    args = ["prep", "profile", str(tiny.model_dir), "--data", str(corpus), "--out", str(out), "--distributed"]
    result = run_in_process(*args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --distributed needs torchrun's environment") and "torchrun --nproc" in lines[0]
    assert not out.exists()


def test_a_rank_outside_the_world_is_refused() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(UserError, match="RANK 2 is not one of WORLD_SIZE 2"):
        torchrun_shard(env)
    assert state_file(torchrun_shard({**env, "RANK": "1", "LOCAL_RANK": "1"})) == ".profile_state.rank1.pt"
