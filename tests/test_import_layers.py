"""The packages import only downward: core <- formats <- prep, profiles <- planner <- runtime <- cli, and inside the
runtime kernels <- ffn, kv <- model <- engine <- server. Deferred imports (inside functions) count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lower rank = lower layer; `profiles` is data that any layer above the core may read.
RANKS = {
    "qinfer.core": 0,
    "qinfer.formats": 0.5,
    "qinfer.profiles": 1,
    "qinfer.prep": 1,
    "qinfer.planner": 2,
    "qinfer.runtime": 3.0,
    "qinfer.runtime.kernels": 3.0,
    "qinfer.runtime.ffn": 3.1,
    "qinfer.runtime.kv": 3.1,
    "qinfer.runtime.model": 3.2,
    "qinfer.runtime.engine": 3.3,
    "qinfer.runtime.server": 3.4,
    "qinfer.cli": 4,
}


def layer_of(module: str) -> str | None:
    """The layer a dotted module belongs to (the longest RANKS prefix), None outside the project."""
    found = [name for name in RANKS if module == name or module.startswith(name + ".")]
    return max(found, key=len) if found else None


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / "qinfer").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        own = layer_of(module)
        if own is None:
            continue
        for target in sorted({t for t in map(layer_of, imported_modules(path)) if t is not None}):
            if RANKS[target] > RANKS[own] or (own == "qinfer.core" and target != own) or (
                RANKS[target] == RANKS[own] and target != own and own.startswith("qinfer.runtime")
            ):
                bad.append(f"{path.relative_to(root)} imports {target}")
    return bad


def test_every_import_goes_downward() -> None:
    assert upward_imports() == []


def test_the_check_sees_upward_imports(tmp_path: Path) -> None:
    for package, source in {
        "qinfer/core": "import torch\nfrom qinfer.formats.gpuidx import read_gpuidx\n",
        "qinfer/formats": "from qinfer.core import names\nfrom qinfer.prep.convert.convert import convert\n",
        "qinfer/planner": "from qinfer.core import names\nfrom qinfer.runtime.engine import engine\n",
        "qinfer/runtime/kernels": "from qinfer.planner import budget\nfrom qinfer.runtime.kv.cache import KVCache\n",
        "qinfer/runtime/ffn": "from qinfer.runtime.kv import window\nfrom qinfer.runtime.kernels import row_kernels\n",
        "qinfer/runtime/model": "from qinfer.core.names import Key\nfrom qinfer.runtime.ffn.sparse import FFNWeights\n",
    }.items():
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "m.py").write_text(source)
    assert upward_imports(tmp_path) == [
        "qinfer/core/m.py imports qinfer.formats",
        "qinfer/formats/m.py imports qinfer.prep",
        "qinfer/planner/m.py imports qinfer.runtime.engine",
        "qinfer/runtime/ffn/m.py imports qinfer.runtime.kv",
        "qinfer/runtime/kernels/m.py imports qinfer.runtime.kv",
    ]
