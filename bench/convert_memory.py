"""Peak memory of `qinfer prep convert` on a synthetic checkpoint with 7B-shaped layers.

    .venv/bin/python bench/convert_memory.py [--layers 8] [--work DIR]

Writes a random f16 checkpoint (E=4096, F=11008, vocab 32000, one safetensors shard per layer like
the hub's), predictors of rank 1024, and a tokenizer from the tiny synth model; converts it under
/usr/bin/time -v and prints peak RSS against the checkpoint size. Needs about 2.5x the checkpoint on disk.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from qinfer.formats.predictor_dir import FC1, FC2
from qinfer.prep.synth.build import SynthShape, build_synth

E, F, V, HEADS, RANK = 4096, 11008, 32000, 32, 1024


def write_checkpoint(model_dir: Path, predictor_dir: Path, layers: int, tokenizer_dir: Path) -> int:
    model_dir.mkdir(parents=True)
    predictor_dir.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).half()

    shards = layers + 1
    total = 0
    outer = {"model.embed_tokens.weight": rand(V, E), "lm_head.weight": rand(V, E), "model.norm.weight": rand(E)}
    files = [(f"model-{shards:05}-of-{shards:05}.safetensors", outer)]
    for i in range(layers):
        p = f"model.layers.{i}"
        tensors = {
            f"{p}.input_layernorm.weight": rand(E),
            f"{p}.post_attention_layernorm.weight": rand(E),
            **{f"{p}.self_attn.{n}_proj.weight": rand(E, E) for n in "qkvo"},
            f"{p}.mlp.gate_proj.weight": rand(F, E),
            f"{p}.mlp.up_proj.weight": rand(F, E),
            f"{p}.mlp.down_proj.weight": rand(E, F),
        }
        files.append((f"model-{i + 1:05}-of-{shards:05}.safetensors", tensors))
        torch.save({FC1: rand(RANK, E).float(), FC2: rand(F, RANK).float()}, predictor_dir / f"model_{i}.pt")
    for name, tensors in files:
        save_file(tensors, model_dir / name)
        total += (model_dir / name).stat().st_size
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "relu",
        "hidden_size": E,
        "intermediate_size": F,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": V,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    (predictor_dir / "config.json").write_text(json.dumps({"sparse_threshold": 0.0}))
    for source in tokenizer_dir.iterdir():
        if source.name.startswith("tokenizer") or source.name == "special_tokens_map.json":
            shutil.copy(source, model_dir / source.name)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qinfer-convert-bench-", dir=args.work))
    try:
        tiny = build_synth(work / "tok", SynthShape(layers=1, hidden=64, ffn=128), seed=0, train_steps=0)
        checkpoint = write_checkpoint(work / "model", work / "predictor", args.layers, tiny.model_dir)
        predictors = sum(p.stat().st_size for p in (work / "predictor").glob("*.pt"))
        out = work / "out.powerinfer.gguf"
        cmd = [
            "/usr/bin/time",
            "-v",
            sys.executable,
            "-m",
            "qinfer",
            "prep",
            "convert",
            str(work / "model"),
            str(work / "predictor"),
            "--outfile",
            str(out),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        peak_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
        wall = re.search(r"Elapsed \(wall clock\) time .*: (\S+)", result.stderr).group(1)
        peak = peak_kib * 1024
        print(f"layers of 7B shape : {args.layers}")
        print(f"checkpoint (f16)   : {checkpoint / 2**30:.2f} GiB  (+ predictors {predictors / 2**30:.2f} GiB)")
        print(f"output             : {out.stat().st_size / 2**30:.2f} GiB, wall {wall}")
        print(f"peak RSS           : {peak / 2**30:.2f} GiB")
        print(f"peak RSS / checkpoint : {peak / checkpoint:.3f}  (target < 0.35)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
