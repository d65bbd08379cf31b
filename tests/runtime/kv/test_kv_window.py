"""The `window` KV cache against references: the full cache when nothing is evicted, the kept positions and
attention outputs of a float64 replay of the policy, its budget, batched slots and slot reuse."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import torch

from qinfer.core.errors import UserError
from qinfer.core.kv_policy import F32_KV, KVPolicy, parse_kv_budget
from qinfer.core.model_spec import ModelSpec
from qinfer.planner.budget import BudgetOptions, kv_cache_bytes
from qinfer.planner.model_layout import read_model_layout
from qinfer.prep.synth.corpus import synth_corpus
from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.generate import generate, generate_many
from qinfer.runtime.engine.sampling import SamplingParams
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.kv.batch import TokenBatch
from qinfer.runtime.kv.cache import KVCache, make_kv_cache
from qinfer.runtime.kv.window import WindowKVCache
from qinfer.runtime.model.forward import TransformerForward
from qinfer.runtime.model.loader import RuntimeOptions, load_forward
from qinfer.runtime.model.model_file import open_model
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread
from tests.support.cli_in_process import run_in_process

GREEDY = SamplingParams(temperature=0.0)
CTX = 96


@pytest.fixture(scope="module")
def forward(gguf_files: dict[str, Path]) -> TransformerForward:
    return load_forward(open_model(gguf_files["pi-f32"]), RuntimeOptions(ffn="dense")).forward


def token_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(forward: TransformerForward, ids: list[int], cache: KVCache | WindowKVCache, prompt: int) -> torch.Tensor:
    """A prompt of `prompt` tokens, then one token at a time: the logits of every position."""
    with torch.inference_mode():
        parts = [forward.forward(TokenBatch.prompt(torch.tensor(ids[:prompt]), 0), cache)]
        parts += [forward.forward(TokenBatch.decode([t], [prompt + j], [0]), cache) for j, t in enumerate(ids[prompt:])]
    return torch.cat(parts)


def test_full_policy_is_todays_cache(forward: TransformerForward, gguf_files: dict[str, Path]) -> None:
    assert type(make_kv_cache(forward.cfg, CTX, policy=KVPolicy("full"))) is KVCache
    ids = token_ids(40)
    made = decode(forward, ids, make_kv_cache(forward.cfg, CTX, types=F32_KV), 10)
    assert torch.equal(made, decode(forward, ids, KVCache(forward.cfg, CTX, types=F32_KV), 10))
    default = Engine.open(gguf_files["pi-f32"], ctx_size=CTX)
    full = Engine.open(gguf_files["pi-f32"], ctx_size=CTX, kv_policy=KVPolicy("full", 0.25))
    assert type(full.cache) is KVCache
    prompt = "Once upon a time"
    assert generate(full, prompt, 12, GREEDY).tokens == generate(default, prompt, 12, GREEDY).tokens


def test_a_window_as_long_as_the_context_equals_the_full_cache(forward: TransformerForward) -> None:
    ids = token_ids(CTX)
    window = make_kv_cache(forward.cfg, CTX, policy=KVPolicy("window", 1.0))
    assert isinstance(window, WindowKVCache)
    full = decode(forward, ids, make_kv_cache(forward.cfg, CTX, types=F32_KV), 30)
    assert (decode(forward, ids, window, 30) - full).abs().max() < 1e-4


class Recorder(WindowKVCache):
    """Records each call's inputs and outputs, for the replay."""

    calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, qpos: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        out = super()._attend(q, k, v, layer, qpos, slots)
        self.calls.append((layer, q[0].double(), k[0].double(), v[0].double(), qpos[0].clone(), out[0].double()))
        return out


def replay(cfg: ModelSpec, policy: KVPolicy, ctx: int, calls: list) -> dict[int, list[set[int]]]:  # type: ignore[type-arg]
    """The policy as its docstring states it, in float64 and by position: each chunk of new tokens attends the kept
    positions and itself causally; mass decays by `decay` per token; then sinks, the recent window and the highest
    mass fill the rows. Checks each call's output; returns each layer's kept positions per kv head."""
    split = policy.split(ctx)
    decay = 0.5 ** (1 / split.half_life)
    group = cfg.heads // cfg.kv_heads
    kept: dict[int, list[set[int]]] = {}
    mass: dict[int, list[dict[int, float]]] = {}
    keys: dict[int, dict[int, torch.Tensor]] = {}
    values: dict[int, dict[int, torch.Tensor]] = {}
    for layer, q, k, v, qpos, out in calls:
        positions = qpos.tolist()
        if layer not in kept or positions[0] == 0:
            kept[layer] = [set() for _ in range(cfg.kv_heads)]
            mass[layer] = [{} for _ in range(cfg.kv_heads)]
            keys[layer], values[layer] = {}, {}
        for t, p in enumerate(positions):
            keys[layer][p], values[layer][p] = k[t], v[t]
        for h in range(cfg.kv_heads):
            candidates = sorted(kept[layer][h] | set(positions))
            m = mass[layer][h]
            for p in candidates:
                m[p] = m.get(p, 0.0) * decay ** len(positions)
            for t, p in enumerate(positions):
                seen = [c for c in candidates if c <= p]
                kmat = torch.stack([keys[layer][c][h] for c in seen])
                vmat = torch.stack([values[layer][c][h] for c in seen])
                for head in range(h * group, (h + 1) * group):
                    probs = torch.softmax(kmat @ q[t, head] / math.sqrt(cfg.head_dim), dim=0)
                    assert torch.allclose(probs @ vmat, out[t, head], atol=1e-4)
                    for c, pr in zip(seen, probs.tolist(), strict=True):
                        m[c] += pr * decay ** (len(positions) - 1 - t)
            last = positions[-1]
            protected = [c for c in candidates if c < split.sinks or c > last - split.recent]
            others = sorted((c for c in candidates if c not in protected), key=lambda c: -m[c])
            kept[layer][h] = set(protected) | set(others[: split.rows - len(protected)])
    return kept


@pytest.mark.parametrize(("policy", "prompt"), [(KVPolicy("window", 24), 5), (KVPolicy("window", 16), 40)])
def test_kept_positions_and_outputs_match_a_float64_replay(
    forward: TransformerForward, policy: KVPolicy, prompt: int
) -> None:
    cfg = forward.cfg
    cache = Recorder(cfg, CTX, 1, "cpu", policy)
    cache.calls = []
    decode(forward, token_ids(70, seed=1), cache, prompt)
    expected = replay(cfg, policy, CTX, cache.calls)
    split = policy.split(CTX)
    assert split.heavy > 0
    for layer in range(cfg.layers):
        for h in range(cfg.kv_heads):
            got = cache.pos[layer, 0, h]
            assert set(got.tolist()) == expected[layer][h]
            assert len(expected[layer][h]) == split.rows == got.numel()
    # Heavy hitters really are chosen by mass: some kept position is neither a sink nor recent.
    assert any(split.sinks <= p < 70 - split.recent for p in cache.pos.flatten().tolist())


def test_sinks_and_recent_window_keep_exactly_the_hand_computed_positions(forward: TransformerForward) -> None:
    policy = KVPolicy("window", 20, sinks=3, recent_share=1.0)
    cache = make_kv_cache(forward.cfg, CTX, policy=policy)
    decode(forward, token_ids(50), cache, 8)
    expected = {0, 1, 2, *range(50 - 17, 50)}
    assert isinstance(cache, WindowKVCache)
    for positions in cache.pos.reshape(-1, cache.rows).tolist():
        assert set(positions) == expected


def test_window_never_exceeds_its_budget_in_prompts_decode_and_batches(forward: TransformerForward) -> None:
    policy = KVPolicy("window", 0.25)
    cache = make_kv_cache(forward.cfg, 512, slots=3, policy=policy)
    assert isinstance(cache, WindowKVCache)
    size = cache.nbytes
    assert cache.k.shape[3] == policy.rows(512) == 128
    with torch.inference_mode():
        # A prompt longer than the rows and than one chunk, then decode steps of three slots together.
        forward.forward(TokenBatch.prompt(torch.tensor(token_ids(300)), 0, slot=0), cache)
        forward.forward(TokenBatch.prompt(torch.tensor(token_ids(20, 2)), 0, slot=1), cache)
        for j in range(40):
            forward.forward(TokenBatch.decode([5, 6, 7], [300 + j, 20 + j, j], [0, 1, 2]), cache)
    assert cache.nbytes == size
    for slot, end in ((0, 340), (1, 60), (2, 40)):
        held = cache.pos[:, slot]
        assert ((held >= 0).sum(-1) == min(end, 128)).all()
        assert int(held.max()) == end - 1
        # The window's newest tokens are always there.
        newest = set(range(end - policy.split(512).recent, end))
        assert all(newest <= set(row) for row in held.reshape(-1, 128).tolist())


def test_batched_slots_and_slot_reuse_equal_each_sequence_alone(gguf_files: dict[str, Path]) -> None:
    policy = KVPolicy("window", 24)
    prompts = ["Once upon a time", "The dog ran fast, and the cat slept.", "Tom said"]
    alone = Engine.open(gguf_files["pi-f32"], ctx_size=CTX, ffn="dense", kv_policy=policy)
    expected = [generate(alone, p, 30, GREEDY, ignore_eos=True).tokens for p in prompts]
    together = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=CTX, ffn="dense", kv_policy=policy)
    # Three prompts on two slots: the third reuses a slot that held 40 positions of another sequence.
    assert [r.tokens for r in generate_many(together, prompts, 30, GREEDY, ignore_eos=True)] == expected


def test_budget_parsing_and_errors() -> None:
    assert parse_kv_budget("512") == 512
    assert parse_kv_budget("0.25") == parse_kv_budget("25%") == 0.25
    assert KVPolicy("window", 0.25).rows(2048) == 512
    assert KVPolicy("window", 4096).rows(2048) == 2048
    assert KVPolicy("full", 0.1).rows(2048) == 2048
    for bad in ("abc", "0", "-3", "nan", "12.5", "inf"):
        with pytest.raises(UserError):
            parse_kv_budget(bad)
    with pytest.raises(UserError, match="at least 4"):
        KVPolicy("window", 3).rows(100)
    with pytest.raises(UserError, match="unknown KV policy"):
        KVPolicy("lru")  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "ctx", "slots"), [(KVPolicy(), 96, 1), (KVPolicy("window", 0.25), 256, 3)])
def test_planner_kv_bytes_equal_the_runtime_allocation(
    gguf_files: dict[str, Path], policy: KVPolicy, ctx: int, slots: int
) -> None:
    layout = read_model_layout(gguf_files["pi-f32"])
    planned = kv_cache_bytes(layout, BudgetOptions(ctx_size=ctx, batch=slots, kv_policy=policy)) * layout.n_layers
    # "meta" stands for the GPU the planner budgets (float16), allocating nothing.
    assert make_kv_cache(layout.spec, ctx, slots, "meta", policy).nbytes == planned


def test_run_and_perplexity_take_the_window_policy(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    model = str(gguf_files["pi-f32"])
    ran = run_in_process(
        "run", "-m", model, "-n", "8", "--temp", "0", "-c", "64", "--kv-policy", "window", "--kv-budget", "16"
    )
    assert ran.returncode == 0, ran.stderr
    text = tmp_path / "text.txt"
    text.write_text(synth_corpus(0, 2000, "heldout"))
    scored = run_in_process(
        "perplexity", "-m", model, "-f", str(text), "-c", "64", "--kv-policy", "window", "--kv-budget", "0.25"
    )
    assert scored.returncode == 0, scored.stderr
    assert "KV window of 16 rows" in scored.stderr and "Final estimate" in scored.stdout
    refused = run_in_process("run", "-m", model, "-c", "64", "--kv-policy", "window", "--kv-budget", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "at least 4" in refused.stderr


def test_server_with_a_window_answers_concurrent_clients_as_one_engine_alone(gguf_files: dict[str, Path]) -> None:
    policy = KVPolicy("window", 16)
    prompts = ["Once upon a time", "Lily found a red ball", "The sky was sunny and"]
    alone = Engine.open(gguf_files["pi-f32"], ctx_size=CTX, kv_policy=policy)
    expected = [generate(alone, p, 30, GREEDY, ignore_eos=True).text for p in prompts]
    engine = Engine.open(gguf_files["pi-f32"], slots=2, ctx_size=CTX, kv_policy=policy)
    with serve_in_thread(create_app(EngineWorker(engine), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(prompt: str) -> str:
            extra = {"ignore_eos": True}
            answer = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=30, temperature=0.0, extra_body=extra
            )
            return answer.choices[0].text

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(ask, prompts)) == expected
