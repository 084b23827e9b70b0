"""The dependency rules of the layout (docs/architecture.md), read from the imports; and the doctests.

Everything shipped lives in one top-level package, ``spikehound``: its core modules (``spikehound/*.py``, the
demo) and four components below it (``spikehound.agent``, ``.collector``, ``.detectors``,
``.storage``). The rules speak of "units": a component's name, ``core`` for the rest of ``spikehound``, or the
top-level name of anything else."""

from __future__ import annotations

import ast
import doctest
import graphlib
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("agent", "collector", "detectors", "storage")
PACKAGES = ("spikehound",)
OURS = frozenset(PACKAGES)
OTHERS = frozenset({"tests", "benchmarks", "harness"})  # not shipped: what checks and measures the product
# Not shipped: the tests, the benchmarks, and what both of them run (harness/).
TOOLING = ("tests", "benchmarks", "harness")

# Standard-library modules that do I/O, talk to the network, run concurrently or read a clock.
IO_MODULES = frozenset({
    "os", "io", "pathlib", "shutil", "tempfile", "glob", "socket", "socketserver", "ssl", "select", "selectors",
    "asyncio", "threading", "multiprocessing", "concurrent", "subprocess", "signal", "time", "sched", "sqlite3",
    "dbm", "shelve", "http", "urllib", "ftplib", "smtplib", "imaplib", "poplib", "xmlrpc", "webbrowser", "mmap",
    "fcntl", "resource",
    # third-party I/O, named so that the message says why
    "sqlalchemy", "alembic", "psycopg", "aiohttp", "grpc", "requests", "prometheus_client", "pynvml", "psutil",
})
# Pure computation libraries a detector may use.
PURE_LIBRARIES = frozenset({"river", "numpy", "scipy", "orjson"})


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(name: str) -> str:
    """``spikehound.agent.spool`` -> ``agent``; ``spikehound.model`` -> ``core``; ``numpy.linalg`` -> ``numpy``."""
    parts = name.split(".")
    if parts[0] != "spikehound":
        return parts[0]
    return parts[1] if len(parts) > 1 and parts[1] in COMPONENTS else "core"


def package_dir(name: str) -> str:
    """Where a unit's files are, relative to the repository root."""
    return f"spikehound/{name}" if name in COMPONENTS else name


def is_our_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def source_files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package_dir(package)).rglob("*.py"))


def tracked_files() -> list[Path]:
    """Every file of the repository that git knows (tracked or new), as it is in the working tree."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def core_files() -> list[Path]:
    """The core: ``spikehound/`` less its components."""
    return [p for p in source_files("spikehound")
            if unit(module_name(p)) == "core"]


def imported(path: Path) -> Iterator[tuple[str, str | None, int]]:
    """Every import of ``path``, anywhere in the file (functions too), as (dotted module, name, line): ``name``
    is what a ``from`` import takes from a module or package when it is no module itself, else None."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                # `from storage import schema` imports the module spikehound.storage.schema
                ours = source.split(".")[0] in OURS or source.split(".")[0] in TOOLING
                if ours and is_our_module(candidate):
                    yield candidate, None, node.lineno
                else:
                    yield source, alias.name, node.lineno
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            yield node.args[0].value, None, node.lineno


def imports_of(path: Path) -> Iterator[tuple[str, int]]:
    """Every module ``path`` imports, anywhere in the file (functions too), as (dotted name, line)."""
    for name, _, line in imported(path):
        yield name, line


def top(name: str) -> str:
    return name.split(".")[0]


def violations(packages: tuple[str, ...], allowed: object, *, skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    paths = [p for package in packages for p in (core_files() if package == "core" else source_files(package))]
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if rel in skip:
            continue
        for name, line in imports_of(path):
            reason = allowed(name)  # type: ignore[operator]
            if reason:
                found.append(f"{rel}:{line} imports {name}: {reason}")
    return found


def test_the_import_reader_sees_function_level_and_relative_imports():
    imports = {name for name, _ in imports_of(ROOT / "spikehound" / "cli.py")}
    assert {"spikehound.collector.daemon", "spikehound.storage.migrate", "spikehound.storage.engine",
            "spikehound.config"} <= imports
    env = ROOT / "spikehound" / "storage" / "migrations" / "env.py"
    assert "spikehound.storage.schema" in {name for name, _ in imports_of(env)}
    assert len(source_files(*PACKAGES)) >= 20
    assert {unit(module_name(p)) for p in source_files("spikehound")} == {"core", *COMPONENTS}


def test_one_top_level_package_and_no_bare_component_import():
    """The distribution installs ``spikehound`` alone; ``import agent`` (a PyPI name like ``storage``) would
    import somebody else's package in a model server's environment."""
    bare = [f"{path.relative_to(ROOT).as_posix()}:{line} imports {name}"
            for package in ("spikehound", *TOOLING) for path in source_files(package)
            for name, line in imports_of(path) if top(name) in COMPONENTS]
    assert bare == []
    shipped = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name not in TOOLING)
    assert shipped == ["spikehound"]
    written = [f"{path.relative_to(ROOT).as_posix()}: {match.group(0)}"
               for path in tracked_files() if path.suffix in (".py", ".toml", ".service", ".md", ".sh", "")
               for match in re.finditer(r"(?:-m |PackageLoader\(\")(?:agent|collector|detectors|storage)\.\w+",
                                        path.read_text(errors="replace"))]
    assert written == []


def test_the_core_imports_no_component_except_from_the_cli():
    def rule(name: str) -> str | None:
        if unit(name) in COMPONENTS:
            return "the core (spikehound/) must not know the components; only spikehound/cli.py may"
        return None

    assert violations(("core",), rule, skip=("spikehound/cli.py",)) == []


def test_detectors_are_pure_computation_on_the_core_model():
    def rule(name: str) -> str | None:
        if unit(name) == "detectors" or name in ("spikehound.model", "spikehound.units"):
            return None
        if top(name) in IO_MODULES:
            return "detectors do no I/O, networking, storage or clock reading"
        if top(name) in OURS:
            return "detectors know only the core model (spikehound.model) and its units (spikehound.units)"
        if top(name) in PURE_LIBRARIES or top(name) in sys.stdlib_module_names:
            return None
        return "not a pure computation library"

    assert violations(("detectors",), rule) == []


def test_detectors_never_read_a_clock():
    clocks = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "process_time",
              "now", "utcnow", "today"}
    clock_owners = {"time", "datetime", "date", "dt", "loop"}
    found = []
    for path in source_files("detectors"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in clocks):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in clock_owners:
                found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} reads a clock ({name}.{node.attr})")
    assert found == [], "time comes in with the data"


def test_storage_imports_the_core_sqlalchemy_alembic_and_orjson_only():
    def rule(name: str) -> str | None:
        if name == "spikehound.cli" or name.startswith("spikehound.cli."):
            return "the CLI knows every package; the core that storage may use is the rest of spikehound/"
        if unit(name) in ("storage", "core"):  # the core: the model, its OTLP conversion (span blocks), ...
            return None
        if top(name) in OURS:
            return "storage must not know the other components"
        if top(name) in ("sqlalchemy", "alembic", "orjson") or top(name) in sys.stdlib_module_names:
            return None
        return "storage depends on SQLAlchemy, Alembic and orjson only"

    assert violations(("storage",), rule) == []


def test_the_agent_talks_to_the_collector_over_otlp_only():
    def rule(name: str) -> str | None:
        if unit(name) in ("collector", "detectors", "storage"):
            return "the agent talks to the collector over OTLP only"
        return None

    assert violations(("agent",), rule) == []


def test_no_test_module_is_imported():
    """What tests share lives in tests/support/ (or, shared with the benchmarks, in harness/); fixtures reach a
    test through tests/conftest.py. A test module imported by another runs its module-level code twice and
    ties the two together."""

    def rule(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] == "tests" and len(parts) > 1 and (parts[1].startswith("test_") or parts[1] == "conftest"):
            return "a test module or conftest.py is no library: move what is shared to tests/support/"
        return None

    assert violations(TOOLING, rule) == []


def test_tests_and_benchmarks_do_not_import_each_other():
    """Both may use harness/ (the traffic generators among it: harness/scenarios/) and the product; harness/
    uses neither of them."""

    def rule_for(package: str) -> object:
        def rule(name: str) -> str | None:
            if top(name) in TOOLING and top(name) != package and top(name) != "harness":
                return f"{package}/ must not import {top(name)}/ (what both need belongs in harness/)"
            if package == "harness" and top(name) in ("tests", "benchmarks"):
                return "harness/ is shared by tests/ and benchmarks/ and imports neither"
            return None

        return rule

    found = [v for package in TOOLING for v in violations((package,), rule_for(package))]
    assert found == []
    # the rule sees the imports it is about
    assert "harness.daemons" in {name for name, _ in imports_of(ROOT / "tests" / "conftest.py")}


def test_the_product_imports_nothing_that_checks_or_measures_it():
    """tests/, benchmarks/ and harness/ (the scenario generators included) are not installed: an import of
    them from spikehound/ works in this checkout and fails in every installed copy."""

    def rule(name: str) -> str | None:
        if top(name) in TOOLING:
            return f"{top(name)}/ is not shipped; what the product needs belongs in spikehound/"
        return None

    assert violations(PACKAGES, rule) == []
    # the rule sees the imports it is about
    assert "harness.scenarios.traffic" in {name for name, _ in imports_of(ROOT / "harness" / "detection.py")}


# --- public surfaces ---------------------------------------------------------------------------
# Each package below spikehound/ names in its __init__.py's ``__all__`` what the code outside it may import:
# its public modules (and subpackages), or names its __init__.py defines. A package's own modules, its
# subpackages' included, may import any of its modules. The tests, the benchmarks and the harness look inside
# on purpose and are not held to the surfaces.

PACKAGE_NAMES = sorted(module_name(p) for p in (ROOT / "spikehound").rglob("__init__.py"))
# Packages whose __init__.py is edited elsewhere at present: their surface is named here until their
# ``__all__`` says it (test_every_package_names_its_public_surface then asks for the entry to go).
SURFACES_NOT_YET_IN_INIT: dict[str, tuple[str, ...]] = {
    "spikehound.agent": ("daemon", "runtime"),
    "spikehound.agent.samplers": ("cpu", "network", "nvml"),
    "spikehound.collector.cluster": ("leader", "member"),
}


def init_file(package: str) -> Path:
    return ROOT.joinpath(*package.split(".")) / "__init__.py"


def declared_all(package: str) -> list[str] | None:
    """The ``__all__`` of ``package``'s __init__.py, read without importing it; None when it has none."""
    for node in ast.parse(init_file(package).read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets):
            assert node.value is not None
            return list(ast.literal_eval(node.value))
    return None


def surface(package: str) -> frozenset[str]:
    declared = declared_all(package)
    return frozenset(SURFACES_NOT_YET_IN_INIT[package] if declared is None else declared)


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def off_surface(importer: str, target: str, name: str | None) -> str | None:
    """Why ``importer`` may not import ``target`` (or ``name`` from the package ``target``); None if it may."""
    parts = target.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in PACKAGE_NAMES:
            break
        if not inside(importer, package) and parts[depth] not in surface(package):
            return f"{parts[depth]} is not in {package}'s __all__ (its public surface)"
    if name is not None and target in PACKAGE_NAMES and not inside(importer, target) and name not in surface(target):
        return f"{name} is not in {target}'s __all__ (its public surface)"
    return None


def test_every_package_names_its_public_surface():
    missing = [p for p in PACKAGE_NAMES if declared_all(p) is None and p not in SURFACES_NOT_YET_IN_INIT]
    assert missing == [], "give each package an __all__ in its __init__.py"
    assert [p for p in SURFACES_NOT_YET_IN_INIT if declared_all(p) is not None] == [], \
        "the package's __init__.py names its surface now: drop its entry from SURFACES_NOT_YET_IN_INIT"
    unknown = []
    for package in PACKAGE_NAMES:
        tree = ast.parse(init_file(package).read_text())
        bound = {alias.asname or alias.name.split(".")[0] for node in tree.body
                 if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        bound |= {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        bound |= {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                  if isinstance(target, ast.Name)}
        unknown += [f"{package}.{name}" for name in surface(package)
                    if name not in bound and not is_our_module(f"{package}.{name}")]
    assert unknown == [], "a surface names modules of its package or what its __init__.py defines"


def test_packages_import_each_other_through_their_public_surfaces():
    found = []
    for path in source_files(*PACKAGES):
        importer = module_name(path)
        for target, name, line in imported(path):
            if top(target) in OURS and (reason := off_surface(importer, target, name)):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{line} imports {target}"
                             f"{f' {name}' if name else ''}: {reason}")
    assert found == []
    # the rule sees what it is about
    assert off_surface("spikehound.cli", "spikehound.detectors.windows", None)
    assert off_surface("spikehound.cli", "spikehound.collector.web.pages", None)
    assert off_surface("spikehound.collector.daemon", "spikehound.collector.notifiers", "WebhookNotifier")
    assert off_surface("spikehound.detectors.engine", "spikehound.detectors.windows", None) is None
    assert off_surface("spikehound.collector.web.pages", "spikehound.collector.rest.common", None) is None


# --- the collector's wiring -------------------------------------------------------------------


def test_the_collector_has_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for path in source_files("collector"):
        module = module_name(path)
        graph[module] = {name for name, _ in imports_of(path)
                         if unit(name) == "collector" and name != module and is_our_module(name)}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle inside spikehound/collector/: {' -> '.join(exc.args[1])}")


def test_the_collector_imports_at_module_level_only():
    """A function-level import of our own code is how a cycle hides; the collector has none."""
    found = []
    for path in source_files("collector"):
        tree = ast.parse(path.read_text(), filename=str(path))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top_level:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(top(n) in OURS for n in names) or (isinstance(node, ast.ImportFrom) and node.level):
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}")
    assert found == []


def test_no_private_name_is_imported_across_modules():
    found = []
    for path in source_files(*PACKAGES, "tests", "benchmarks", "harness"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or top(node.module or "") in OURS | OTHERS):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno} imports {', '.join(private)}"
                                 f" from {node.module}")
    assert found == []


@pytest.mark.parametrize("module", ["spikehound.detectors.engine", "spikehound.collector.alerts.routing",
                                    "spikehound.collector.alerts.matchers", "spikehound.collector.alerts.notification",
                                    "spikehound.model_json"])
def test_detectors_and_alert_routing_load_no_web_framework(module):
    """Checked in a fresh interpreter, so that what the imported modules import counts too."""
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print(' '.join(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert [m for m in loaded if top(m) in ("aiohttp", "jinja2")] == []


# --- doctests ---------------------------------------------------------------------------------

DOCTESTED = ("spikehound", "harness/scenarios")  # the scenarios' doctests say what the generators make
DOCTEST_MODULES = sorted(module_name(p) for p in source_files(*DOCTESTED) if ">>>" in p.read_text())


def test_the_doctested_modules_are_found():
    assert {"spikehound.config", "spikehound.model", "spikehound.timefmt", "spikehound.otlp",
            "spikehound.storage.engine", "harness.scenarios.traffic"} <= set(DOCTEST_MODULES)


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name))

    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} doctest example(s) of {name} failed (the report is above)"
