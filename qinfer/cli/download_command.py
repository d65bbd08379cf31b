"""`qinfer prep download`: fetch a supported model from the Hugging Face hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, cast

import typer

from qinfer.cli.app import err, prep


@prep.command("download")
def download_cmd(
    model: Annotated[str, typer.Argument(help="Model name from `qinfer profiles` (for example ReluLLaMA-7B).")],
    source: Annotated[
        str, typer.Option(help="gguf: the PowerInfer GGUF repo; original: HF weights + predictors (then convert).")
    ] = "gguf",
    variant: Annotated[
        str | None, typer.Option(help="f16 or q4 GGUF (gguf source); default f16 where published, else q4.")
    ] = None,
    dir: Annotated[Path | None, typer.Option("--dir", help="Target directory; default models/MODEL.")] = None,
) -> None:
    """Download MODEL through the standard hub cache (resumable; HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT apply).

    Prints the model's path (the GGUF, or the checkpoint directory of the originals) on stdout, for scripts.
    """
    from qinfer.prep.hub.download import Source, Variant, download
    from qinfer.prep.hub.model_profiles import load_model_profile

    profile = load_model_profile(model)
    dest = dir if dir is not None else Path("models") / profile.name

    def show(done: int, total: int, what: str) -> None:
        err.print(f"[{done + 1}/{total}] {what}")

    result = download(profile, dest, cast(Source, source), cast(Variant | None, variant), on_file=show)
    main = result.model_file or result.model_dir
    err.print(f"{profile.name}: {len(result.files)} files in {result.dir}")
    print(main)
