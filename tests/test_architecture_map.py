"""docs/architecture.md names every module of spikehound/, and no module that is not there.

The modules are the ``.py`` files under ``spikehound/``. An ``__init__.py`` is one only when it holds more than
its docstring, ``from __future__`` imports and ``__all__``.

How the doc names a file: a *path token* is a run of letters, digits, ``_``, ``-``, ``.`` and ``/`` that ends
in ``.py`` (``spikehound/collector/rest/app.py``, ``collector/rest/app.py``, ``rest/app.py``, ``app.py``). Each
token is read by the first of these rules that applies:

* it starts with ``spikehound/``: a repository path; the file must exist;
* its first part is another directory at the repository's root (``tests/``, ``benchmarks/``, ``harness/``):
  not part of the map, ignored;
* otherwise it is the tail of a module's path, cut at a ``/``: it must end the path of at least one ``.py``
  file under ``spikehound/``, and it names a module only when it ends exactly one (``telemetry.py`` ends
  four and names none: write ``agent/telemetry.py``).

A module is mentioned when one token names it. The test fails naming each module no token names and each
token that names no file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "spikehound"
TOKEN = re.compile(r"[\w./-]*\w\.py\b")
# What an __init__.py may hold and still be no module of its own.
TRIVIAL_NAMES = frozenset({"__all__"})


def _is_trivial(statement: ast.stmt, index: int) -> bool:
    if index == 0 and isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
            and isinstance(statement.value.value, str):
        return True  # the docstring
    if isinstance(statement, ast.ImportFrom) and statement.module == "__future__":
        return True
    if isinstance(statement, ast.Assign):
        return all(isinstance(t, ast.Name) and t.id in TRIVIAL_NAMES for t in statement.targets)
    if isinstance(statement, ast.AnnAssign):
        return isinstance(statement.target, ast.Name) and statement.target.id in TRIVIAL_NAMES
    return False


def python_files() -> list[str]:
    """Every ``.py`` file under spikehound/, as repository paths."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")
                  if "__pycache__" not in p.parts)


def modules(files: list[str]) -> list[str]:
    """The files the map must name: all but the ``__init__.py`` files that hold no code of their own."""
    kept = []
    for path in files:
        if path.endswith("/__init__.py"):
            body = ast.parse((ROOT / path).read_text(encoding="utf-8")).body
            if all(_is_trivial(statement, i) for i, statement in enumerate(body)):
                continue
        kept.append(path)
    return kept


def read_map(files: list[str]) -> tuple[set[str], list[str]]:
    """The modules the doc names, and the tokens that name no file."""
    other_roots = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != PACKAGE}
    named: set[str] = set()
    dangling: list[str] = []
    for token in dict.fromkeys(TOKEN.findall(DOC.read_text(encoding="utf-8"))):
        if token.startswith(PACKAGE + "/"):
            if token in files:
                named.add(token)
            else:
                dangling.append(token)
            continue
        if "/" in token and token.split("/", 1)[0] in other_roots:
            continue
        ends = [path for path in files if path.endswith("/" + token)]
        if not ends:
            dangling.append(token)
        elif len(ends) == 1:
            named.add(ends[0])
    return named, dangling


def test_architecture_names_every_module() -> None:
    files = python_files()
    named, dangling = read_map(files)
    unnamed = [path for path in modules(files) if path not in named]
    problems = [f"not named in docs/architecture.md: {path}" for path in unnamed]
    problems += [f"named in docs/architecture.md but no such file under spikehound/: {token}" for token in dangling]
    assert not problems, "\n".join(problems)
