"""The import directions of `docs/architecture.md`, enforced: every import of every module under src/kvprefix (at
module level, in a function, under TYPE_CHECKING, or a module named by a string for a lazy import) must be allowed
by the doc's dependency table, the package graph must have no cycle, and the torch-free packages must stay so. The
table is parsed from the doc, so the doc is the one statement of the layering."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "kvprefix"
DOC = REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Rule:
    allowed: frozenset[str]
    torch: bool


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. kvprefix.router.app
    target: str  # the imported module, e.g. kvprefix.server.app
    line: int


def read_table(doc: Path = DOC) -> dict[str, Rule]:
    """The rows of the `| package | may import | torch |` table in the doc's "Dependencies point one way"."""
    section = doc.read_text().split("## Dependencies point one way", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, Rule] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        package = cells[0].strip("`")
        rules[package] = Rule(frozenset(re.findall(r"`([a-z_]+)`", cells[1])), cells[2] == "torch")
    assert rules, f"no dependency table found in {doc}"
    return rules


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (the kvprefix package folder) by its dotted name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(p for p in parts if p != "__init__")] = path
    return names


def imports_of(name: str, path: Path, known: set[str]) -> list[Import]:
    """Every module ``name`` imports, anywhere in it; ``known`` resolves `from pkg import submodule`."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in known:
            targets = [node.value]  # a lazy import by name: importlib.import_module("kvprefix.x")
        found += [Import(name, t, node.lineno) for t in targets]
    return found


def node_of(module: str) -> str | None:
    """The table row a kvprefix module belongs to: its package, `cli` (also every `__main__`: a command, which
    nothing imports), or `kvprefix` (the package's __init__)."""
    parts = module.split(".")
    if parts[0] != "kvprefix":
        return None
    if parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else "kvprefix"


def check(root: Path, rules: dict[str, Rule]) -> list[str]:
    """Everything wrong with the imports under ``root``, one line each; empty when the layering holds."""
    modules = module_names(root)
    problems = []
    nodes = {node_of(m) for m in modules}
    problems += [f"{n}: a package with no row in the table of {DOC.name}" for n in sorted(nodes - set(rules))]
    problems += [f"{n}: a row of {DOC.name} that names no package" for n in sorted(set(rules) - nodes)]
    graph: dict[str, set[str]] = {n: set() for n in rules}
    for name, path in modules.items():
        src = node_of(name)
        for imp in imports_of(name, path, set(modules)):
            dst = node_of(imp.target)
            if imp.target.split(".")[0] == "torch" and src in rules and not rules[src].torch:
                problems.append(f"{name} (line {imp.line}) imports {imp.target}: {src} must not import torch")
            if dst is None or dst == src:
                continue
            graph.setdefault(src, set()).add(dst)
            if src in rules and dst not in rules[src].allowed:
                problems.append(f"{name} (line {imp.line}) imports {imp.target}: {src} may not import {dst} "
                                f"(allowed: {', '.join(sorted(rules[src].allowed)) or 'nothing of ours'})")
    table = {n: set(r.allowed) for n, r in rules.items()}
    problems += [f"cycle in the table of {DOC.name}: {' -> '.join(c)}" for c in cycles(table)]
    problems += [f"cycle between packages: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one node (or a self loop), as a path."""
    found, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def torch_free_closure(rules: dict[str, Rule]) -> list[str]:
    """The packages whose whole allowed closure imports no torch: importing them must not load it."""
    def closure(n: str, seen: set[str]) -> set[str]:
        for d in rules[n].allowed - seen:
            seen.add(d)
            closure(d, seen)
        return seen

    return sorted(n for n, r in rules.items() if not r.torch and not any(rules[d].torch for d in closure(n, set())))


def source_with(tmp_path: Path, module: str, code: str) -> Path:
    """A copy of the source tree with ``code`` appended to ``module`` (a path under kvprefix/, created if absent)."""
    root = tmp_path / "kvprefix"
    shutil.copytree(SRC, root)
    with open(root / module, "a") as f:
        f.write(code)
    return root


def test_every_import_follows_the_table_in_architecture_md():
    problems = check(SRC, read_table())
    assert not problems, "\n".join(problems)


def test_the_table_says_server_and_router_never_import_each_other():
    rules = read_table()
    assert "router" not in rules["server"].allowed and "server" not in rules["router"].allowed
    assert not {"engine", "model"} & rules["router"].allowed and not rules["router"].torch


@pytest.mark.parametrize("where, line", [
    ("in a function", "\n\ndef _wrong():\n    from kvprefix.server import app\n    return app\n"),
    ("under TYPE_CHECKING", "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvprefix.server.app\n"),
    ("by name", "\nimport importlib\n_WRONG = importlib.import_module('kvprefix.server.app')\n"),
])
def test_a_wrong_import_is_reported(tmp_path: Path, where: str, line: str):
    """A copy of the source with router importing server, written three ways: the checker names the module, the
    line and the import."""
    problems = check(source_with(tmp_path, "router/policies.py", line), read_table())
    assert any(p.startswith("kvprefix.router.policies (line ") and "imports kvprefix.server.app: router may not "
               "import server" in p for p in problems), (where, problems)


def test_a_cycle_between_packages_is_reported(tmp_path: Path):
    """tokenizer importing prompts closes prompts -> tokenizer -> prompts: reported as a violation and a cycle."""
    code = "\n\ndef _wrong():\n    from kvprefix.prompts import render\n    return render\n"
    problems = check(source_with(tmp_path, "tokenizer/detokenizer.py", code), read_table())
    assert any("kvprefix.tokenizer.detokenizer (line" in p and "tokenizer may not import prompts" in p
               for p in problems), problems
    assert any(p.startswith("cycle between packages:") and "prompts -> tokenizer -> prompts" in p
               for p in problems), problems


def test_torch_in_a_torch_free_package_is_reported(tmp_path: Path):
    code = "\n\ndef _wrong():\n    import torch\n    return torch\n"
    problems = check(source_with(tmp_path, "cache/stats.py", code), read_table())
    assert any(p.startswith("kvprefix.cache.stats (line") and "cache must not import torch" in p
               for p in problems), problems


def test_torch_free_packages_import_without_torch_the_model_or_the_engine():
    """Every module of the packages whose allowed imports are all torch-free (cache, tokenizer, prompts, logs, http,
    router, sim, doctor, ...), and `kvprefix` and `kvprefix.cli`, import in a fresh interpreter without loading
    torch, the model, the engine or the server; none but tokenizer.builtin loads transformers. The Ray code
    (router.ray) is left out: importing Ray takes seconds, and the static check holds it to no
    torch."""
    packages = torch_free_closure(read_table())
    assert {"cache", "tokenizer", "prompts", "logs", "http", "router", "sim", "doctor"} <= set(packages)
    names = [m for m in module_names(SRC) if node_of(m) in packages and "ray" not in m.split(".")]
    names += ["kvprefix", "kvprefix.cli"]  # they import the engine and the subcommands lazily: light at import
    late = ["kvprefix.tokenizer.builtin"]  # its PreTrainedTokenizerFast is transformers (not torch)
    forbidden = ("torch", "kvprefix.model", "kvprefix.engine", "kvprefix.server")
    code = (
        "import importlib, sys\n"
        f"for n in {[n for n in names if n not in late]!r}: importlib.import_module(n)\n"
        f"print(sorted(m for m in {forbidden + ('transformers',)!r} if m in sys.modules))\n"
        f"for n in {late!r}: importlib.import_module(n)\n"
        f"print(sorted(m for m in {forbidden!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout


def test_a_main_module_is_a_command(tmp_path: Path):
    """`python -m kvprefix.router` would be a command: held to the `cli` row, so it may run `kvprefix.cli` but not
    reach past what the command may import."""
    root = source_with(tmp_path, "router/__main__.py", "from kvprefix.cli import main\nfrom kvprefix.logs import x\n")
    problems = [p for p in check(root, read_table()) if "__main__" in p]
    assert problems == ["kvprefix.router.__main__ (line 2) imports kvprefix.logs: cli may not import logs "
                        "(allowed: doctor, engine, router, server, sim, tiers)"], problems
