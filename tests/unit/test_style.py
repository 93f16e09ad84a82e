"""Style the linter would hold the code to, checked without it: the line-length limit of
pyproject.toml's ``[tool.ruff]`` for every Python file git knows of."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def line_length() -> int:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["ruff"]["line-length"]


def python_files() -> list[Path]:
    """Every .py file git tracks, and the new ones it would (not ignored), as they are now."""
    r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], capture_output=True, text=True, cwd=ROOT, check=True)
    return [ROOT / name for name in sorted(set(r.stdout.splitlines())) if (ROOT / name).is_file()]


def test_no_line_is_longer_than_the_limit():
    limit = line_length()
    files = python_files()
    assert files, "git lists no Python files"
    long = []
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > limit:
                long.append(f"{path.relative_to(ROOT)}:{n}: {len(line)} characters")
    assert not long, f"{len(long)} lines longer than {limit} characters:\n" + "\n".join(long)
