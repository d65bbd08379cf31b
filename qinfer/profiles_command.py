"""`qinfer profiles`: the supported models and the device profiles the planner knows."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from qinfer.app import app


@app.command("profiles")
def profiles_cmd() -> None:
    """List the supported models (hub repos, files, shapes) and the GPU and CPU profiles."""
    from planner.device_profiles import known_profiles, load_profile
    from qinfer_prep.model_profiles import known_models

    models = Table(title="Models (qinfer prep download NAME)")
    for column in (
        "name",
        "arch",
        "E",
        "F",
        "L",
        "heads/kv",
        "vocab",
        "repos: GGUF, original, predictor",
        "f16 / q4 files",
    ):
        models.add_column(column)
    for m in known_models():
        s = m.spec
        files = f"{m.gguf_f16 or '-'}\n{m.gguf_q4 or '-'}"
        models.add_row(
            m.name,
            s.arch,
            str(s.hidden),
            str(s.ffn),
            str(s.layers),
            f"{s.heads}/{s.kv_heads}",
            str(s.vocab_size),
            f"{m.gguf_repo}\n{m.original_repo}\n{m.predictor_repo}",
            files,
        )
    devices = Table(title="Devices (qinfer plan --device / --cpu)")
    for column in ("name", "kind", "memory GiB", "bandwidth GB/s", "TFLOP/s", "PCIe GB/s", "description"):
        devices.add_column(column)
    for kind in ("gpu", "cpu"):
        for name in known_profiles(kind):
            d = load_profile(name, kind)
            devices.add_row(
                d.name,
                d.kind,
                f"{d.memory_bytes / 2**30:g}",
                f"{d.bandwidth / 1e9:g}",
                f"{d.flops / 1e12:g}",
                f"{d.pcie_bandwidth / 1e9:g}",
                d.description,
            )
    out = Console()
    out.print(models)
    out.print(devices)
