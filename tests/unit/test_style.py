"""Style the linter would hold the code to, checked without it: the line-length limit of
pyproject.toml's ``[tool.ruff]`` for every Python file git knows of; and the sizes that keep the
package easy to pick up: no function of irdmafs/ over ``FUNCTION_LINES`` lines, no class over
``CLASS_METHODS`` methods (docs/design.md, "Module map")."""

from __future__ import annotations

import ast
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


FUNCTION_LINES = 80
CLASS_METHODS = 25
# classes whose size is a table, not two jobs: the pyfuse3 op table (one method per kernel
# request)
LARGE_BY_NATURE = {("irdmafs/fs/ops.py", "Operations")}


def sizes(path: Path, rel: str) -> tuple[list[str], list[str]]:
    """(functions over FUNCTION_LINES lines, classes over CLASS_METHODS methods) of one file."""
    long, large = [], []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > FUNCTION_LINES:
                long.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - first + 1} lines")
        elif isinstance(node, ast.ClassDef) and (rel, node.name) not in LARGE_BY_NATURE:
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > CLASS_METHODS:
                large.append(f"{rel}:{node.lineno} {node.name}: {len(methods)} methods")
    return long, large


def test_no_function_is_over_the_limit_and_no_class_holds_too_many_methods():
    long, large = [], []
    for path in python_files():
        rel = str(path.relative_to(ROOT))
        if rel.startswith("irdmafs/"):
            f, c = sizes(path, rel)
            long += f
            large += c
    assert not long and not large, "\n".join(long + large)


def test_the_size_check_counts_lines_and_methods(tmp_path):
    src = tmp_path / "m.py"
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(CLASS_METHODS + 1))
    src.write_text("def f():\n" + "    x = 1\n" * FUNCTION_LINES + "\n\nclass K:\n" + body)
    long, large = sizes(src, "irdmafs/m.py")
    assert long == [f"irdmafs/m.py:1 f: {FUNCTION_LINES + 1} lines"]
    assert large == [f"irdmafs/m.py:{FUNCTION_LINES + 4} K: {CLASS_METHODS + 1} methods"]


SYNC_NAMES = {"bsp", "asp", "ssp", "r2sp"}


def policy_branches(path: Path, rel: str) -> list[str]:
    """Where a comparison in one file names a sync policy (``x == "bsp"``, ``kind in ("asp",)``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
        if isinstance(node, ast.Compare):
            consts = [c.value for side in [node.left, *node.comparators] for c in ast.walk(side) if isinstance(c, ast.Constant)]
            if SYNC_NAMES & {c for c in consts if isinstance(c, str)}:
                out.append(f"{rel}:{node.lineno}")
    return out


def test_no_code_outside_the_policies_branches_on_a_sync_policys_name():
    """Each sync policy is a class of irdmafs/policy.py saying what its pushes and pulls wait
    for (``rounds``, ``holds``, ``paced``, ``required_clock``, ``clock``, ``admitted``): the node
    and the client ask those, never which policy it is (docs/design.md, U4)."""
    found = []
    for path in python_files():
        rel = str(path.relative_to(ROOT))
        if rel.startswith("irdmafs/") and rel != "irdmafs/policy.py":
            found += policy_branches(path, rel)
    assert not found, "branches on a sync policy's name:\n" + "\n".join(found)


def test_the_policy_check_finds_a_branch_on_a_name(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('if info["sync"] == "bsp":\n    pass\nok = kind in ("sgd", "adam")\nbad = kind in ("asp", "r2sp")\n')
    assert policy_branches(src, "irdmafs/m.py") == ["irdmafs/m.py:1", "irdmafs/m.py:4"]
