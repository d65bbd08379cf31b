"""`qinfer plan` in a hostile environment: stopped by SIGTERM or SIGINT while its solver runs, it ends the solver's
process and removes its files, and says so in one line; a pipe where its .gpuidx goes is refused, neither read
(which would wait for a writer forever) nor renamed over.

The command runs in a subprocess, as a signal finds it; CBC is replaced by a script that records its pid and waits,
so that the signal always lands while the solver runs."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qinfer.formats.gpuidx import gpuidx_path_for
from tests.support.fake_activation import write_power_law_activation

FAKE_CBC = "#!/bin/sh\necho $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 600\n"
# `qinfer ARGS` with pulp's bundled CBC swapped for the script at argv[1].
DRIVER = (
    "import sys; from pulp.apis import coin_api; coin_api.PULP_CBC_CMD.pulp_cbc_path = sys.argv[1]; "
    "from qinfer.cli.main import main; sys.argv = ['qinfer', *sys.argv[2:]]; main()"
)
STARTUP_S = 180  # a shared machine's imports of torch and transformers, with room to spare


@pytest.fixture
def model(tmp_path: Path, gguf_files: dict[str, Path]) -> Path:
    work = tmp_path / "model"
    work.mkdir()
    path = Path(shutil.copy(gguf_files["pi-f16"], work / "tiny.powerinfer.gguf"))
    write_power_law_activation(work / "activation")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_for(path: Path, process: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + STARTUP_S
    while not path.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the solver never started"
        time.sleep(0.1)
    return int(path.read_text())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("args", [["plan"], ["run", "-p", "Once", "-n", "1"]], ids=["plan", "run"])
def test_a_stopped_plan_ends_its_solver_and_removes_its_files(
    model: Path, tmp_path: Path, signum: signal.Signals, args: list[str]
) -> None:
    """`plan`, and `run` (or `serve`) planning on the spot as they load a model with a budget."""
    cbc, pid_file, scratch = tmp_path / "cbc", tmp_path / "cbc.pid", tmp_path / "scratch"
    cbc.write_text(FAKE_CBC.format(pid_file=pid_file))
    cbc.chmod(0o755)
    scratch.mkdir()
    command = [sys.executable, "-c", DRIVER, str(cbc), *args, "-m", str(model), "--vram-budget", "8"]
    env = {**os.environ, "TMPDIR": str(scratch)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    solver = None
    try:
        solver = _wait_for(pid_file, process)
        assert sorted(p.suffix for p in scratch.rglob("*-pulp.*")) == [".mps"]  # the program CBC was given
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 128 + signum, stderr
        assert stderr.strip() == f"error: stopped by {signum.name} before it finished; run the command again to finish"
        assert not _alive(solver)
        assert list(scratch.iterdir()) == []
        assert sorted(p.name for p in model.parent.iterdir()) == ["activation", model.name]
    finally:
        process.kill()
        process.wait()
        if solver is not None and _alive(solver):
            os.kill(solver, signal.SIGKILL)


def test_plan_refuses_a_pipe_where_its_gpuidx_goes(model: Path) -> None:
    gpuidx = gpuidx_path_for(model)
    os.mkfifo(gpuidx)
    for extra in ([], ["--reset-gpu-index"]):
        result = subprocess.run(
            [sys.executable, "-m", "qinfer", "plan", "-m", str(model), "--vram-budget", "8", *extra],
            capture_output=True,
            text=True,
            timeout=STARTUP_S,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            f"error: cannot write {gpuidx}: it is a named pipe, not a regular file; pick another path for the output"
        )
        assert stat.S_ISFIFO(gpuidx.lstat().st_mode)
