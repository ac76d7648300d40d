"""docs/design.md stays true: every function, method and file its PD walk-through names
exists where the page says (`file.Class.method`, `file.function`, `Class.method`, a path),
so a newcomer who follows one PD request through it lands on real code."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "shared", "pdmesh", "kernels")
DOC = ROOT / "docs" / "design.md"
DOTTED = re.compile(r"(?<![\w/.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:/\w+)*)")
PATH = re.compile(r"(?<![\w.])((?:[\w-]+/)*[\w-]+\.(?:py|cpp))\b")


@cache
def index():
    """(module stem or package dir -> its top-level names, class -> its members)."""
    modules: dict[str, set[str]] = defaultdict(set)
    classes: dict[str, set[str]] = defaultdict(set)
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    top.add(node.name)
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    top |= {t.id for t in targets if isinstance(t, ast.Name)}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    for b in node.body:
                        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                            classes[node.name].add(b.name)
                        elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                            classes[node.name].add(b.target.id)
                        elif isinstance(b, ast.Assign):
                            classes[node.name] |= {t.id for t in b.targets
                                                   if isinstance(t, ast.Name)}
            rel = path.relative_to(ROOT)
            for key in {path.stem, *rel.parts[:-1]} - {"__init__"}:
                modules[key] |= top
    return modules, classes


def resolves(name: str) -> bool:
    modules, classes = index()
    head, *rest = name.split(".")
    if head in classes and len(rest) == 1:
        return rest[0] in classes[head]
    if head in modules:
        if len(rest) == 1:
            return rest[0] in modules[head]
        if len(rest) == 2:
            return rest[0] in modules[head] and rest[1] in classes.get(rest[0], ())
    return False


def walkthrough() -> str:
    text = DOC.read_text()
    start = text.index("```", text.index("## A PD request"))     # the diagram on
    return text[start:text.index("## Invariants")]


def names(text: str) -> list[str]:
    """Every dotted name (`A.b/c` is A.b and A.c), file paths left out."""
    out = []
    for m in DOTTED.finditer(text):
        tok = m.group(1)
        if tok.endswith((".py", ".cpp")) or re.search(r"\.(py|cpp)\b", tok):
            continue
        first, *alts = tok.split("/")
        out.append(first)
        out += [first.rsplit(".", 1)[0] + "." + a for a in alts]
    return out


def test_every_name_in_the_walkthrough_exists_where_it_says():
    found = names(walkthrough())
    assert len(found) > 50, "the walk-through lost its names"
    missing = sorted({n for n in found if not resolves(n)})
    assert not missing, "docs/design.md names what the code does not have:\n" + "\n".join(missing)


PLACEHOLDERS = {"Class.method", "file.Class.method", "file.function"}   # the page's notation


def test_every_name_on_the_page_exists():
    """The map, the invariants table and the prose too, not only the walk-through."""
    missing = sorted({n for n in names(DOC.read_text()) if not resolves(n)} - PLACEHOLDERS)
    assert not missing, "docs/design.md names what the code does not have:\n" + "\n".join(missing)


def test_no_unqualified_private_names():
    """A bare `_name` says nothing about where it is: the page writes Class._name."""
    bare = re.findall(r"(?<![\w.])(_[a-z]\w*)", walkthrough())
    assert not bare, f"qualify these in docs/design.md: {sorted(set(bare))}"


def test_every_file_the_page_names_exists():
    text = DOC.read_text()
    missing = []
    for path in sorted(set(PATH.findall(text))):
        if "/" in path:     # from the root, or from services/ (decode/inject.py)
            ok = (ROOT / path).exists() or (ROOT / "services" / path).exists()
        else:     # a bare file name: somewhere in the project
            ok = any((ROOT / pkg).rglob(path) for pkg in PACKAGES) or \
                any(ROOT.glob(f"*/{path}"))
        if not ok:
            missing.append(path)
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


def test_the_checker_catches_a_wrong_name():
    assert resolves("DecodeClient.send") and resolves("dispatch.DecodeClient.submit")
    assert not resolves("DecodeClient._send")          # the drift this test was made for
    assert not resolves("dispatch.NoSuchClass.submit")
    assert names("KvstoreService.on_fetch/on_layer, shared/kv/wire.py") == [
        "KvstoreService.on_fetch", "KvstoreService.on_layer"]
