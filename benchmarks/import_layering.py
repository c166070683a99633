"""Which streamkv package imports which (issue 31's "import layering, before and after"),
read from the source with ``ast``: every ``import streamkv...`` / ``from streamkv...``
statement, at module level or inside a function (lazy), grouped by the importing file's
package and the imported one. Packages are streamkv's subpackages (``core``, ``engine``,
...); a top-level module (``config.py``, ``messages.py``) counts as its own name. Then the
cycles between packages, module-level imports only and with lazy ones too.

    .venv/bin/python benchmarks/import_layering.py --json-out /tmp/layering.json
    git worktree add /tmp/before c23a555^ && \\
        .venv/bin/python benchmarks/import_layering.py --tree /tmp/before

Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.trace_request_path import git_commit  # noqa: E402


def package_of(module: str) -> str | None:
    """``streamkv.core.scheduler`` -> ``core``; ``streamkv.config`` -> ``config``."""
    parts = module.split(".")
    if parts[0] != "streamkv" or len(parts) < 2:
        return None
    return parts[1]


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(tree: ast.Module, this: str) -> list[tuple[str, bool]]:
    """(imported streamkv module, at module level?) for every import that can run."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub, top)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module
                    base = this.split(".")[: -child.level]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod == "streamkv":  # from streamkv import LLM / from streamkv import core
                    found.extend((f"streamkv.{a.name}", top) for a in child.names)
                else:
                    found.append((mod, top))
            inner = top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            visit(child, inner)

    visit(tree, True)
    return found


def layering(tree: Path) -> dict[str, dict[str, dict[str, int]]]:
    """{importer package: {imported package: {"top": n, "lazy": n}}}, itself left out."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(
        lambda: defaultdict(lambda: {"top": 0, "lazy": 0})
    )
    pkg_root = tree / "streamkv"
    # `from streamkv import LLM` names no module: only real subpackages and modules count.
    known = {p.stem for p in pkg_root.iterdir() if p.is_dir() or p.suffix == ".py"}
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(tree).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        src = package_of(module) if module != "streamkv" else "streamkv"
        if src is None:
            continue
        for imported, top in imports_of(ast.parse(path.read_text()), module):
            dst = package_of(imported)
            if dst is None or dst == src or dst not in known:
                continue
            out[src][dst]["top" if top else "lazy"] += 1
    return {s: dict(d) for s, d in out.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(groups)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout to read (default: this)")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if not (args.tree / "streamkv" / "__init__.py").exists():
        p.error(f"--tree {args.tree}: no streamkv/ package there")
    table = layering(args.tree)
    print(f"streamkv import layering at {git_commit(args.tree)} (module level; [lazy])")
    for src in sorted(table):
        parts = []
        for dst in sorted(table[src]):
            n = table[src][dst]
            parts.append(dst if n["top"] else f"[{dst}]")
        print(f"  {src:<16} -> {', '.join(parts)}")
    top_edges = {s: {d for d, n in ds.items() if n["top"]} for s, ds in table.items()}
    all_edges = {s: set(ds) for s, ds in table.items()}
    top_cycles, all_cycles = cycles(top_edges), cycles(all_edges)
    print(f"cycles, module-level imports: {top_cycles or 'none'}")
    print(f"cycles, lazy imports too:     {all_cycles or 'none'}")
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "commit": git_commit(args.tree),
                    "imports": table,
                    "cycles_module_level": top_cycles,
                    "cycles_with_lazy": all_cycles,
                },
                indent=1,
                sort_keys=True,
            )
        )
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
