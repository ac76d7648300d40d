"""The shape of the code: file and function sizes, layering, import cycles.

  - no .py file outside tests/ over MAX_FILE_LINES lines;
  - no function over MAX_FUNCTION_LINES lines outside tests/ and scripts/;
  - the decode and prefill service classes under MAX_SERVICE_CLASS_LINES lines;
  - nothing under shared/ imports `services` (shared is the layer below the services);
  - no private `_name` of a project module used by another module (outside tests/);
  - no import cycle among the project's modules (module-level imports only: an import
    inside a function or under `if TYPE_CHECKING:` runs later or never, so it cannot
    deadlock a module's first import).
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdmesh", "shared", "services", "kernels")   # the importable project modules
SKIP_DIRS = {".venv", ".git", "build", "dist", "node_modules", "__pycache__"}
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_SERVICE_CLASS_LINES = 300
SERVICE_CLASSES = [("services/decode/service.py", "DecodeService"),
                   ("services/prefill/service.py", "PrefillService")]


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


def line_count(rel: Path) -> int:
    return len((ROOT / rel).read_text().splitlines())


def functions(node: ast.AST):
    """Every function and method, nested ones included."""
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield n


# ---- sizes ---------------------------------------------------------------------------------
def test_no_source_file_over_the_line_limit():
    big = [f"{rel}: {n} lines" for rel in python_files() if rel.parts[0] != "tests"
           for n in [line_count(rel)] if n > MAX_FILE_LINES]
    assert not big, f"over {MAX_FILE_LINES} lines (split by responsibility):\n" + "\n".join(big)


def test_no_function_over_the_line_limit():
    long = [f"{rel}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
            for rel in python_files() if rel.parts[0] not in ("tests", "scripts")
            for f in functions(tree(rel)) if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("path,name", SERVICE_CLASSES)
def test_service_class_stays_small(path, name):
    cls = next((n for n in ast.walk(tree(Path(path)))
                if isinstance(n, ast.ClassDef) and n.name == name), None)
    assert cls is not None, f"{path} has no class {name}"
    n = cls.end_lineno - cls.lineno + 1
    assert n < MAX_SERVICE_CLASS_LINES, \
        f"{name} is {n} lines: move a responsibility out (< {MAX_SERVICE_CLASS_LINES})"


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


def test_shared_does_not_import_services():
    bad = [f"{rel}:{node.lineno} imports {name}"
           for rel in python_files() if rel.parts[0] == "shared"
           for node in ast.walk(tree(rel)) if isinstance(node, (ast.Import, ast.ImportFrom))
           for name in imported_names(rel, node)[:1]
           if name == "services" or name.startswith("services.")]
    assert not bad, "shared/ is below the services and must not import them:\n" + "\n".join(bad)


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


def test_only_the_engine_touches_its_lock_and_tables():
    """Outside shared/engine/ (and tests/), an engine is used through its methods and its
    KvPort (shared/engine/kv_port.py): nobody else takes its lock or reads its pool,
    scheduler, request table or prefix cache, so every rule about what may change while
    a step runs lives in the engine."""
    bad = [line for rel in python_files()
           if rel.parts[0] != "tests" and rel.parts[:2] != ("shared", "engine")
           for line in engine_reaches(rel)]
    assert not bad, "engine internals used outside shared/engine:\n" + "\n".join(bad)


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
