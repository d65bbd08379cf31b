"""Every file the pipeline writes keeps its bytes: SHA-256 of converted, dense, quantized and `.gpuidx` files of the
synth models (llama, bamboo, falcon, opt), against recorded hashes, on every machine.

The synth builders train and multiply in float arithmetic, whose last bits differ from CPU to CPU, so the inputs
here are their checkpoints with every weight replaced by seeded integers over powers of two (seeded_checkpoint.py),
and the activation counts are integers: the same bytes on any CPU. Their hashes are recorded too, so a change of
the inputs (the tokenizer trainer, the seeding) is told apart from a change of the writers. The outputs were first
recorded this way on the commit before the runtime moved into its rooms, whose writers matched the earlier
recording made from trained inputs. `QINFER_RECORD_GOLDEN=1` rewrites the file: do that only on a commit whose
writers are known good.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from qinfer.formats.gpuidx import gpuidx_path_for
from qinfer.planner.make_plan import PlanOptions, dry_run_account, load_or_make_gpuidx
from qinfer.prep.convert.convert import convert
from qinfer.prep.convert.quantize import quantize_gguf
from qinfer.prep.synth.build import SynthReport
from qinfer.prep.synth.falcon import FalconShape, build_synth_falcon
from qinfer.prep.synth.opt import OPTShape, build_synth_opt
from tests.support.seeded_checkpoint import reseed, write_integer_power_law_activation

GOLDEN = Path(__file__).with_name("golden_sha256.json")
RECORD = os.environ.get("QINFER_RECORD_GOLDEN") == "1"
# A fixed model mtime, since the .gpuidx records it as provenance.
MTIME_NS = 1_700_000_000_000_000_000


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree_sha(directory: Path) -> str:
    """The directory's files, each config's `transformers_version` left out: it names the library that saved the
    checkpoint (the floor test's is older), which no writer reads."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name.endswith("config.json"):
            config = json.loads(data)
            config.pop("transformers_version", None)
            data = json.dumps(config, sort_keys=True).encode()
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0" + data)
    return digest.hexdigest()


def _gpuidx(model: Path) -> Path:
    write_integer_power_law_activation(model.parent / "activation")
    os.utime(model, ns=(MTIME_NS, MTIME_NS))
    _, acct = dry_run_account(model, 1 << 40, PlanOptions())
    load_or_make_gpuidx(model, int(acct.dense + acct.ffn_total / 3), options=PlanOptions(), reset=True)
    return gpuidx_path_for(model)


@pytest.fixture(scope="module")
def outputs(tiny: SynthReport, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    out = tmp_path_factory.mktemp("golden")
    llama_model = Path(shutil.copytree(tiny.model_dir, out / "llama" / "model"))
    llama_predictor = Path(shutil.copytree(tiny.predictor_dir, out / "llama" / "predictor"))
    reseed(out / "llama", seed=1)
    inputs = {"llama-model": _tree_sha(llama_model), "llama-predictor": _tree_sha(llama_predictor)}
    files: dict[str, Path] = {}
    for outtype in ("f32", "f16"):
        files[f"llama-pi-{outtype}"] = convert(
            llama_model, out / f"l-{outtype}.powerinfer.gguf", llama_predictor, outtype
        ).outfile
        files[f"llama-dense-{outtype}"] = convert(llama_model, out / f"l-{outtype}.gguf", None, outtype).outfile
    for qtype in ("Q4_0", "Q8_0"):
        files[f"llama-pi-{qtype}"] = quantize_gguf(
            files["llama-pi-f16"], out / f"l-{qtype}.powerinfer.gguf", qtype
        ).outfile
    files["llama-dense-Q4_0"] = quantize_gguf(files["llama-dense-f16"], out / "l-Q4_0.gguf", "Q4_0").outfile
    plan_dir = out / "plan"
    plan_dir.mkdir()
    files["llama-gpuidx"] = _gpuidx(Path(shutil.copy(files["llama-pi-f16"], plan_dir / "l.powerinfer.gguf")))

    bamboo = Path(shutil.copytree(llama_model, out / "bamboo"))
    config = json.loads((bamboo / "config.json").read_text())
    (bamboo / "config.json").write_text(json.dumps({**config, "architectures": ["BambooForCausalLM"]}))
    files["bamboo-pi-f16"] = convert(bamboo, out / "b-f16.powerinfer.gguf", llama_predictor, "f16").outfile

    falcon_model, falcon_predictor = build_synth_falcon(out / "falcon", FalconShape())
    reseed(out / "falcon", seed=2)
    inputs |= {"falcon-model": _tree_sha(falcon_model), "falcon-predictor": _tree_sha(falcon_predictor)}
    files["falcon-pi-f16"] = convert(falcon_model, out / "f-f16.powerinfer.gguf", falcon_predictor, "f16").outfile
    files["falcon-dense-f32"] = convert(falcon_model, out / "f-f32.gguf", None, "f32").outfile
    files["falcon-pi-Q4_0"] = quantize_gguf(files["falcon-pi-f16"], out / "f-Q4_0.powerinfer.gguf", "Q4_0").outfile
    opt_model, opt_predictor = build_synth_opt(out / "opt", OPTShape())
    reseed(out / "opt", seed=3)
    inputs |= {"opt-model": _tree_sha(opt_model), "opt-predictor": _tree_sha(opt_predictor)}
    files["opt-pi-f16"] = convert(opt_model, out / "o-f16.powerinfer.gguf", opt_predictor, "f16").outfile
    files["opt-dense-f32"] = convert(opt_model, out / "o-f32.gguf", None, "f32").outfile
    files["opt-pi-Q4_0"] = quantize_gguf(files["opt-pi-f16"], out / "o-Q4_0.powerinfer.gguf", "Q4_0").outfile
    return inputs, {name: _sha(path) for name, path in files.items()}


def test_outputs_are_byte_identical(outputs: tuple[dict[str, str], dict[str, str]]) -> None:
    inputs, hashes = outputs
    if RECORD:
        GOLDEN.write_text(json.dumps({"inputs": inputs, "outputs": hashes}, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())
    if hashes != golden["outputs"]:
        # Inputs may differ and still give the same outputs (a config saved by an older transformers lists fewer
        # defaults): the writers are judged by their outputs, the inputs only say which side changed.
        changed = "the seeded inputs changed: the tokenizer trainer or the seeding, not a writer"
        assert inputs == golden["inputs"], changed
        assert hashes == golden["outputs"]
