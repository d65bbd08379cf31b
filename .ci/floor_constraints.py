"""Print a pip constraints file that pins every direct dependency to the lowest version pyproject.toml allows.

`make test-floor` installs the project with it, so the floors we state are the versions the suite runs on.
Usage: python .ci/floor_constraints.py [EXTRA ...]   (the extras whose dependencies are pinned too)
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)")


def floors(pyproject: Path, extras: list[str]) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra named {', '.join(unknown)}")
    requirements = [*project["dependencies"], *(r for extra in extras for r in optional[extra])]
    pinned = {}
    for requirement in requirements:
        match = FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"{requirement!r} states no lower bound (name>=version); every dependency needs one")
        pinned[match[1].lower().replace("_", "-")] = match[2]
    return pinned


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    for name, version in floors(root / "pyproject.toml", sys.argv[1:]).items():
        print(f"{name}=={version}")
