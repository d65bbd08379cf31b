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


def upward_imports() -> list[str]:
    bad = []
    for package, rank in RANKS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imported_packages(path):
                if RANKS[target] > rank or (package == "qinfer_core" and target != package):
                    bad.append(f"{path.relative_to(ROOT)} imports {target}")
    return bad


def test_every_import_goes_downward() -> None:
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import torch\nfrom planner.budget import GIB\nfrom qinfer_core import names\n")
    assert imported_packages(module) == {"planner", "qinfer_core"}
