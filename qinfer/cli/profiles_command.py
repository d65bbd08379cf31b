"""`qinfer profiles`: the supported models and the device profiles the planner knows."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from qinfer.cli.app import app

if TYPE_CHECKING:
    from qinfer.planner.device_profiles import DeviceProfile
    from qinfer.prep.hub.model_profiles import ModelProfile

MODELS_TITLE = "Models (qinfer prep download NAME)"
DEVICES_TITLE = "Devices (qinfer plan --device / --cpu)"
MODEL_COLUMNS = (
    "name",
    "arch",
    "E",
    "F",
    "L",
    "heads/kv",
    "vocab",
    "repos: GGUF, original, predictor",
    "f16 / q4 files",
)
DEVICE_COLUMNS = ("name", "kind", "memory GiB", "bandwidth GB/s", "TFLOP/s", "PCIe GB/s", "description")
MEASURE_WIDTH = 10_000  # wide enough that a table's measured width is its natural one, not the terminal's


@app.command("profiles")
def profiles_cmd() -> None:
    """List the supported models (hub repos, files, shapes) and the GPU and CPU profiles.

    Tables when they fit the terminal; otherwise, and when piped, plain lines, since a table squeezed to the
    width would cut the model names and repos that are there to be copied.
    """
    from qinfer.planner.device_profiles import known_profiles, load_profile
    from qinfer.prep.hub.model_profiles import known_models

    models = known_models()
    devices = [load_profile(name, kind) for kind in ("gpu", "cpu") for name in known_profiles(kind)]
    out = Console()
    tables = [_model_table(models), _device_table(devices)]
    wide = out.options.update_width(MEASURE_WIDTH)
    if out.is_terminal and all(out.measure(table, options=wide).maximum <= out.width for table in tables):
        for table in tables:
            out.print(table)
        return
    lines = [MODELS_TITLE, *(line for m in models for line in _model_lines(m))]
    lines += ["", DEVICES_TITLE, *(line for d in devices for line in _device_lines(d))]
    # Plain print: rich would wrap or crop long lines to the width.
    print("\n".join(lines))


def _model_table(models: list[ModelProfile]) -> Table:
    table = Table(title=MODELS_TITLE)
    for column in MODEL_COLUMNS:
        table.add_column(column)
    for m in models:
        s = m.spec
        table.add_row(
            m.name,
            s.arch,
            str(s.hidden),
            str(s.ffn),
            str(s.layers),
            f"{s.heads}/{s.kv_heads}",
            str(s.vocab_size),
            f"{m.gguf_repo}\n{m.original_repo}\n{m.predictor_repo}",
            f"{m.gguf_f16 or '-'}\n{m.gguf_q4 or '-'}",
        )
    return table


def _model_lines(m: ModelProfile) -> list[str]:
    s = m.spec
    return [
        f"{m.name}: {s.arch}, E {s.hidden}, F {s.ffn}, L {s.layers}, heads/kv {s.heads}/{s.kv_heads}, "
        f"vocab {s.vocab_size}",
        f"  GGUF repo:      {m.gguf_repo}",
        f"  original repo:  {m.original_repo}",
        f"  predictor repo: {m.predictor_repo}",
        f"  f16 / q4 files: {m.gguf_f16 or '-'} / {m.gguf_q4 or '-'}",
    ]


def _device_cells(d: DeviceProfile) -> tuple[str, ...]:
    return (
        d.name,
        d.kind,
        f"{d.memory_bytes / 2**30:g}",
        f"{d.bandwidth / 1e9:g}",
        f"{d.flops / 1e12:g}",
        f"{d.pcie_bandwidth / 1e9:g}",
        d.description,
    )


def _device_table(devices: list[DeviceProfile]) -> Table:
    table = Table(title=DEVICES_TITLE)
    for column in DEVICE_COLUMNS:
        table.add_column(column)
    for d in devices:
        table.add_row(*_device_cells(d))
    return table


def _device_lines(d: DeviceProfile) -> list[str]:
    name, kind, memory, bandwidth, tflops, pcie, description = _device_cells(d)
    return [
        f"{name}: {kind}, {memory} GiB, {bandwidth} GB/s, {tflops} TFLOP/s, PCIe {pcie} GB/s",
        f"  {description}",
    ]
