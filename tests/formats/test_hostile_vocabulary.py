"""Well-formed GGUFs whose vocabulary is hostile: a token of a megabyte, a million tokens for 512 embedding rows,
scores or token types of another length, a token twice, merges of tokens the vocabulary lacks. Each is refused in
one line when the model opens, within a second, before any tokenizer is built from it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, GGUFValueType

from qinfer.core.errors import UserError
from qinfer.core.names import Key
from qinfer.formats.gguf_layout import MAX_TOKEN_BYTES
from qinfer.prep.convert.convert import convert
from qinfer.prep.synth.opt import OPTShape, build_synth_opt
from qinfer.runtime.engine.tokenizer import GGUFTokenizer
from qinfer.runtime.model.model_file import open_model
from tests.support.cli_in_process import run_in_process
from tests.support.gguf_rewrite import rewrite_gguf

S, F32, I32 = GGUFValueType.STRING, GGUFValueType.FLOAT32, GGUFValueType.INT32
Vocabulary = dict[str, list[Any]]
Attack = Callable[[Vocabulary, random.Random], tuple[dict[str, tuple[Any, GGUFValueType]], str]]


def long_token(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    tokens = list(v["tokens"])
    tokens[rng.randrange(len(tokens))] = "x" * (1 << 20)
    return {Key.TOKENS: (tokens, S)}, f"over the {MAX_TOKEN_BYTES} allowed"


def million_tokens(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    return {Key.TOKENS: ([f"t{i}" for i in range(10**6)], S)}, "has 1000000 tokens but token_embd.weight has"


def few_scores(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    return {Key.SCORES: (v["scores"][:10], F32)}, "has 10 entries for"


def short_token_types(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    cut = rng.randrange(1, len(v["types"]))
    return {Key.TOKEN_TYPE: (v["types"][:cut], I32)}, f"has {cut} entries for"


def duplicate_token(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    tokens = list(v["tokens"])
    i, j = rng.sample(range(len(tokens)), 2)
    tokens[j] = tokens[i]
    return {Key.TOKENS: (tokens, S)}, "twice"


def every_token_the_same(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    return {Key.TOKENS: (["a"] * len(v["tokens"]), S)}, "twice"


def foreign_merge(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    merges = list(v["merges"])
    merges[rng.randrange(len(merges))] = "qinfer-no-such-token Ġzz"
    return {Key.MERGES: (merges, S)}, "does not join two tokens of the vocabulary"


def merge_of_three(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    merges = list(v["merges"])
    merges[0] = merges[0] + " " + merges[1]
    return {Key.MERGES: (merges, S)}, "does not join two tokens of the vocabulary"


def long_merge(v: Vocabulary, rng: random.Random) -> tuple[dict[str, tuple[Any, GGUFValueType]], str]:
    """One byte over the longest rule (a token of MAX_TOKEN_BYTES, split in two, and a space)."""
    merges = list(v["merges"])
    merges[rng.randrange(len(merges))] = "x" * (MAX_TOKEN_BYTES // 2) + " " + "x" * (MAX_TOKEN_BYTES // 2 + 1)
    return {Key.MERGES: (merges, S)}, f"over the {MAX_TOKEN_BYTES + 1} allowed"


LLAMA_ATTACKS = [long_token, million_tokens, few_scores, short_token_types, duplicate_token, every_token_the_same]
GPT2_ATTACKS = [long_token, duplicate_token, foreign_merge, merge_of_three, long_merge]


def vocabulary(path: Path) -> Vocabulary:
    reader = GGUFReader(path)
    found = {"tokens": Key.TOKENS, "scores": Key.SCORES, "types": Key.TOKEN_TYPE, "merges": Key.MERGES}
    return {name: reader.get_field(key).contents() for name, key in found.items() if reader.get_field(key)}


@pytest.fixture(scope="module")
def opt_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("opt")
    model, _ = build_synth_opt(out / "synth", OPTShape())
    return convert(model, out / "opt.gguf", None, "f32").outfile


def _attack(source: Path, attack: Attack, seed: int, out: Path) -> None:
    rng = random.Random(seed)
    replace, expected = attack(vocabulary(source), rng)
    hostile = rewrite_gguf(source, out / f"{attack.__name__}.gguf", replace)  # type: ignore[arg-type]
    started = time.perf_counter()
    with pytest.raises(UserError, match=expected):
        GGUFTokenizer(open_model(hostile).metadata)
    assert time.perf_counter() - started < 2.0  # a second on two cores, with room for a loaded CI machine


@pytest.mark.parametrize("attack", LLAMA_ATTACKS, ids=lambda a: a.__name__)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_hostile_sentencepiece_vocabulary_is_refused(
    gguf_files: dict[str, Path], tmp_path: Path, attack: Attack, seed: int
) -> None:
    _attack(gguf_files["dense-f32"], attack, seed, tmp_path)


@pytest.mark.parametrize("attack", GPT2_ATTACKS, ids=lambda a: a.__name__)
def test_a_hostile_gpt2_vocabulary_is_refused(opt_dense: Path, tmp_path: Path, attack: Attack) -> None:
    _attack(opt_dense, attack, 0, tmp_path)


def test_the_untouched_vocabularies_still_open(gguf_files: dict[str, Path], opt_dense: Path, tmp_path: Path) -> None:
    for source in (gguf_files["dense-f32"], opt_dense):
        copy = rewrite_gguf(source, tmp_path / source.name, {})
        GGUFTokenizer(open_model(copy).metadata).encode("Once upon a time")


def test_a_token_of_the_longest_length_and_its_merge_are_read(opt_dense: Path, tmp_path: Path) -> None:
    """GPT-NeoX's vocabulary ends its runs of spaces at a token of MAX_TOKEN_BYTES, made by a merge of its two
    halves, a rule one byte longer."""
    v = vocabulary(opt_dense)
    used = {part for rule in v["merges"] for part in (*rule.split(" "), rule.replace(" ", ""))}
    free = [i for i, token in enumerate(v["tokens"]) if token not in used and v["types"][i] == 1][-2:]
    half, whole = "Ġ" * (MAX_TOKEN_BYTES // 4), "Ġ" * (MAX_TOKEN_BYTES // 2)  # Ġ is 2 bytes of UTF-8
    tokens = list(v["tokens"])
    tokens[free[0]], tokens[free[1]] = half, whole
    merges = [*v["merges"], f"{half} {half}"]
    assert len(merges[-1].encode()) == MAX_TOKEN_BYTES + 1
    longest = rewrite_gguf(opt_dense, tmp_path / "longest.gguf", {Key.TOKENS: (tokens, S), Key.MERGES: (merges, S)})
    tokenizer = GGUFTokenizer(open_model(longest).metadata)
    assert tokenizer.backend.token_to_id(whole) == free[1]


def test_the_cli_says_it_in_one_line(gguf_files: dict[str, Path], tmp_path: Path) -> None:
    replace, _ = duplicate_token(vocabulary(gguf_files["dense-f32"]), random.Random(0))
    hostile = rewrite_gguf(gguf_files["dense-f32"], tmp_path / "dup.gguf", replace)
    result = run_in_process("run", "-m", str(hostile), "-p", "Once", "-n", "2")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "twice" in result.stderr
