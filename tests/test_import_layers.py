"""The packages import only downward: core <- prep <- planner <- runtime <- the `qinfer` CLI."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lower rank = lower layer; `profiles` is data that any layer above the core may read.
RANKS = {"qinfer_core": 0, "profiles": 1, "qinfer_prep": 1, "planner": 2, "qinfer_runtime": 3, "qinfer": 4}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(RANKS)


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for package, rank in RANKS.items():
        for path in sorted((root / package).rglob("*.py")):
            for target in imported_packages(path):
                if RANKS[target] > rank or (package == "qinfer_core" and target != package):
                    bad.append(f"{path.relative_to(root)} imports {target}")
    return bad


def test_every_import_goes_downward() -> None:
    assert upward_imports() == []


def test_the_check_sees_upward_imports(tmp_path: Path) -> None:
    for package, source in {
        "qinfer_core": "import torch\nfrom qinfer_prep.convert import convert\n",
        "planner": "from qinfer_core import names\nfrom qinfer_runtime import engine\n",
        "qinfer_runtime": "import planner.budget\nfrom qinfer_core.names import Key\n",
    }.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "m.py").write_text(source)
    assert upward_imports(tmp_path) == ["qinfer_core/m.py imports qinfer_prep", "planner/m.py imports qinfer_runtime"]
