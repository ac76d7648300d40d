"""The shape of the code: layering, the design map, import cycles, private names.

  - every import (module level or not) goes down the layers LAYERS declares: kernels <
    shared < each service (never another service) < pdmesh's rooms (deploy < local <
    bench < chaos < the command line); the pure cores import nothing that does I/O;
  - every module of the project is named in docs/design.md's map (or, for the engine's
    modules, in docs/engine_layout.md), beside its folder, and every file the map names
    exists: the map is how a reader finds the system, so it may not drift;
  - no private `_name` of a project module used by another module (outside tests/);
  - no import cycle among the project's modules (module-level imports only: an import
    inside a function or under `if TYPE_CHECKING:` runs later or never, so it cannot
    deadlock a module's first import).
Sizes are not limits here: a file is split where it has two ideas, not at a line count.
"""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdmesh", "shared", "services", "kernels")   # the importable project modules
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}


def _skipped(rel: Path) -> bool:
    return any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts)


@cache
def python_files() -> tuple[Path, ...]:
    """Every .py file of the repository (relative paths), virtualenvs and builds aside."""
    return tuple(sorted(p.relative_to(ROOT) for p in ROOT.rglob("*.py")
                        if not _skipped(p.relative_to(ROOT))))


@cache
def tree(rel: Path) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), filename=str(rel))


# ---- imports -------------------------------------------------------------------------------
def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def project_modules() -> dict[str, Path]:
    return {module_name(rel): rel for rel in python_files() if rel.parts[0] in PACKAGES}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_level_imports(node: ast.AST):
    """Import statements that run when the module is imported: not inside a function
    (or a lambda), not under `if TYPE_CHECKING:`; class bodies, if/try blocks count."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (i for n in child.orelse for i in module_level_imports_of(n))
        else:
            yield from module_level_imports(child)


def module_level_imports_of(stmt: ast.AST):
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        yield stmt
    elif not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield from module_level_imports(stmt)


def imported_names(rel: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute dotted names an import statement asks for (`from a import b` -> a.b, a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = module_name(rel).split(".")
        if rel.name != "__init__.py":
            pkg = pkg[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names] + [base]


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module a dotted name lands in (a.b.c -> a.b.c, else a.b, else a)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def import_graph(level=module_level_imports) -> dict[str, set[str]]:
    """module -> the project modules its import runs (parent packages' __init__ included,
    except the importer's own ancestors, which are already importing)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, rel in modules.items():
        own = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
        for node in level(tree(rel)):
            for name in imported_names(rel, node):
                target = _resolve(name, modules)
                if target is None:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    t = ".".join(parts[:i])
                    if t in modules and t != mod and t not in own:
                        graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:   # recursion depth is bounded by the module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# ---- layers --------------------------------------------------------------------------------
SERVICES = "services"          # any one service: services/<name>/
# room -> the rooms it may import besides itself (a service never imports another one)
LAYERS: dict[str, set[str]] = {
    "kernels": set(),
    "shared": {"kernels"},
    SERVICES: {"shared", "kernels"},
    "pdmesh.deploy": {"shared"},
    "pdmesh.local": {"pdmesh.deploy", "shared"},
    "pdmesh.bench": {"pdmesh.local", "pdmesh.deploy", SERVICES, "shared", "kernels"},
    "pdmesh.chaos": {"pdmesh.bench", "pdmesh.local", "pdmesh.deploy", SERVICES, "shared",
                     "kernels"},
    "pdmesh": {"pdmesh.bench", "pdmesh.local", "pdmesh.deploy", "shared"},
}
# clock-free and I/O-free (docs/design.md): callers pass `now`; tests drive them event by event
PURE_CORES = ("services/decode/lifecycle.py", "services/prefill/ledger.py",
              "services/prefill/linkcost.py", "shared/engine/block_pool.py",
              "shared/engine/scheduler.py", "services/decode/monitor.py")
IO_MODULES = {"asyncio", "nats", "aiohttp", "socket", "subprocess", "threading", "time",
              "os", "pathlib", "shutil", "tempfile", "urllib", "requests"}


def room(mod: str) -> str:
    """The layer a project module belongs to: kernels, shared, services.<name>, pdmesh.<sub>
    (local, deploy, bench, chaos) or pdmesh (the command line)."""
    parts = mod.split(".")
    if parts[0] == "services" and len(parts) > 1:
        return f"services.{parts[1]}"
    if parts[0] == "pdmesh" and len(parts) > 1 and (ROOT / "pdmesh" / parts[1]).is_dir():
        return f"pdmesh.{parts[1]}"
    return parts[0]


def crossings() -> list[str]:
    """Every import (at any depth in the file) from one room into another it may not use."""
    modules, bad = project_modules(), []
    for mod, rel in modules.items():
        mine = room(mod)
        allowed = LAYERS[SERVICES if mine.startswith("services.") else mine]
        for node in ast.walk(tree(rel)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in imported_names(rel, node):
                target = _resolve(name, modules)
                theirs = room(target) if target else mine
                kind = SERVICES if theirs.startswith("services.") else theirs
                if theirs != mine and kind not in allowed:
                    bad.append(f"{rel}:{node.lineno} ({mine}) imports {target} ({theirs})")
    return sorted(set(bad))


def test_every_import_goes_down_the_layers():
    bad = crossings()
    assert not bad, "imports against LAYERS:\n" + "\n".join(bad)


def test_the_layer_check_sees_a_crossing(monkeypatch):
    """Switched against the code as it is: shared may not use kernels, and a service
    may not use another one (gateway -> decode is made up here)."""
    monkeypatch.setitem(LAYERS, "shared", set())
    assert any("(shared) imports kernels" in b for b in crossings())
    assert room("services.gateway.app") != room("services.decode.service")


@pytest.mark.parametrize("path", PURE_CORES)
def test_pure_cores_do_no_io(path):
    rel = Path(path)
    used = {name.split(".")[0] for node in ast.walk(tree(rel))
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
            for name in imported_names(rel, node)[-1:]}
    assert not used & IO_MODULES, f"{path} imports {sorted(used & IO_MODULES)}"


# ---- the design map ---------------------------------------------------------------------------
def map_units() -> list[str]:
    """docs/design.md's table rows, and docs/engine_layout.md's sections (a header and the
    lines under it: one folder's modules, one to a line)."""
    units = [line for line in (ROOT / "docs/design.md").read_text().splitlines()
             if line.startswith("|")]
    layout = "\n" + (ROOT / "docs/engine_layout.md").read_text()
    return units + ["#" + u for u in layout.split("\n#")[1:]]


def mapped(rel: Path, units: list[str]) -> bool:
    """Some row or section names one of the file's folders and, beside it, the file's path
    from that folder (`service.py` in the services/decode/ row; spec/verify.py under
    shared/engine)."""
    if any(str(rel) in u for u in units):
        return True
    for folder in list(rel.parents)[:-1]:
        rest = re.compile(r"(?<![\w/])" + re.escape(str(rel.relative_to(folder))) + r"\b")
        if any(str(folder) in u and rest.search(u) for u in units):
            return True
    return False


def test_every_module_is_on_the_design_map():
    units = map_units()
    missing = [str(rel) for rel in python_files() if rel.parts[0] in PACKAGES
               and rel.name not in ("__init__.py", "__main__.py") and not mapped(rel, units)]
    assert not missing, "modules docs/design.md's map does not name (add a line on the " \
        "idea each holds):\n" + "\n".join(missing)


def test_every_file_the_map_names_exists():
    text = (ROOT / "docs/design.md").read_text()
    named = set(re.findall(r"`((?:services|shared|pdmesh|kernels)/[\w/]+\.py)`", text))
    gone = sorted(p for p in named if not (ROOT / p).is_file())
    assert not gone, f"docs/design.md names files that do not exist: {gone}"


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    src = ast.parse("import x\nif TYPE_CHECKING:\n    import y\nelse:\n    import z\n"
                    "def f():\n    import w\nclass C:\n    import v\n")
    names = [a.name for n in module_level_imports(src) for a in n.names]
    assert names == ["x", "z", "v"]


def private_imports(rel: Path) -> list[str]:
    """`from project.module import _name` (a private name taken across modules) and
    `module._name` on an imported project module, in one file."""
    modules = project_modules()
    out, imported = [], set()
    for node in ast.walk(tree(rel)):
        if isinstance(node, ast.ImportFrom):
            base = imported_names(rel, node)[-1]
            if _resolve(base, modules) is None:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{rel}:{node.lineno} from {base} import {a.name}")
                elif f"{base}.{a.name}" in modules:
                    imported.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            imported |= {a.asname or a.name.split(".")[0] for a in node.names
                         if _resolve(a.name, modules)}
    out += [f"{rel}:{n.lineno} {n.value.id}.{n.attr}" for n in ast.walk(tree(rel))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in imported and n.attr.startswith("_") and not n.attr.startswith("__")]
    return out


def test_no_private_names_across_modules():
    """A `_name` is its module's own: another module (outside tests/) that needs it needs
    a public name (and the owner then keeps it as an interface)."""
    bad = [line for rel in python_files() if rel.parts[0] != "tests"
           for line in private_imports(rel)]
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


ENGINE_INTERNALS = {"lock", "pool", "scheduler", "requests", "prefix"}
ENGINE_NAMES = {"eng", "engine"}


def engine_reaches(rel: Path) -> list[str]:
    """`engine.<internal>` / `eng.<internal>` / `x.engine.<internal>` in one file: the
    engine's lock, block pool, scheduler, request table or prefix cache, or a private name."""
    out = []
    for n in ast.walk(tree(rel)):
        if not isinstance(n, ast.Attribute):
            continue
        v = n.value
        owner = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) \
            else None
        if owner in ENGINE_NAMES and (n.attr in ENGINE_INTERNALS or
                                      n.attr.startswith("_") and not n.attr.startswith("__")):
            out.append(f"{rel}:{n.lineno} {owner}.{n.attr}")
    return out


def test_only_the_engine_touches_its_tables():
    """Outside shared/engine/ (and tests/), an engine is used through its methods and its
    KvPort (shared/engine/kv_port.py): nobody else reads its pool, scheduler, request
    table or prefix cache, so every rule about what may change while a step runs lives
    in the engine."""
    bad = [line for rel in python_files()
           if rel.parts[0] != "tests" and rel.parts[:2] != ("shared", "engine")
           for line in engine_reaches(rel)]
    assert not bad, "engine internals used outside shared/engine:\n" + "\n".join(bad)


def test_the_engine_has_one_owner_and_no_lock():
    """The engine's state has one owner thread (engine.py): no lock guards it, and the
    only things that cross threads are the forward (begin_step / forward / end_step) and
    a lower tier's load (its own fence, layer_load.py)."""
    bad = [f"{rel}:{n.lineno}" for rel in python_files() if rel.parts[:2] == ("shared", "engine")
           and rel.name != "layer_load.py" and not rel.parts[2:3] == ("grammar",)
           for n in ast.walk(tree(rel)) if isinstance(n, ast.Attribute)
           and n.attr in ("Lock", "RLock", "lock")]
    assert not bad, "locks in the engine:\n" + "\n".join(bad)


def test_scripts_are_entry_points_without_path_edits():
    """The project is installed (`pip install -e .`): no module or script edits sys.path,
    and none imports the tests (what a benchmark shares with a test is in pdmesh/)."""
    bad = []
    for rel in python_files():
        if rel.parts[0] == "tests":
            continue
        for n in ast.walk(tree(rel)):
            if isinstance(n, ast.Attribute) and n.attr == "path" and \
                    isinstance(n.value, ast.Name) and n.value.id == "sys":
                bad.append(f"{rel}:{n.lineno} sys.path")
            elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in (
                    "tests", "scripts"):
                bad.append(f"{rel}:{n.lineno} from {n.module}")
    assert not bad, "\n".join(bad)
