"""The kernel package's layout: operand layouts below the kernels, each kernel in its own module,
the ops (dispatchers) above them; no module imports a private name of another; no import circles
(function-level imports included); the kernels depend on the formats only (``trace_jax.fp4``).

Checked on the source (``ast``), so a circle that only bites in some import order is found too.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pallas_kernels", "trace_jax", "experiments")

# pallas_kernels' modules by level: a module imports no module of a higher level.
LEVELS = {
    "layouts": 0,
    "dequant": 0,
    "kv_layout": 0,
    "cuda_lowering": 0,
    "fp4_activation": 1,
    "fp4_matmul_triton": 1,
    "fp4_matmul_gemv": 1,
    "fp4_matmul_mgpu": 1,
    "fp4_grouped_matmul_triton": 1,
    "fp4_decode_attention_triton": 1,
    "fp4_decode_attention_mgpu": 1,
    "kv_append_triton": 1,
    "fp4_matmul": 2,
    "fp4_grouped_matmul": 2,
    "fp4_decode_attention": 2,
    "bf16_grouped_matmul": 2,
}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(root: Path, name: str) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def scan(root: Path, packages=PACKAGES):
    """Every import among the project's modules under ``root``.

    Returns (edges: module -> set of modules it imports, counting the packages a submodule
    import initialises; private: ["file:line: what"] for private names of another module,
    imported or read as an attribute of an imported module).
    """
    edges: dict[str, set[str]] = {}
    private: list[str] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            me = _module_name(root, path)
            tree = ast.parse(path.read_text(), str(path))
            targets, aliases = set(), {}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if _is_module(root, a.name):
                            targets.add(a.name)
                            if a.asname:
                                aliases[a.asname] = a.name
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    if not _is_module(root, node.module):
                        continue
                    for a in node.names:
                        full = f"{node.module}.{a.name}"
                        if _is_module(root, full):
                            targets.add(full)
                            aliases[a.asname or a.name] = full
                        else:
                            targets.add(node.module)
                            if a.name.startswith("_") and node.module != me:
                                private.append(f"{path}:{node.lineno}: {node.module}.{a.name}")
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id in aliases
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and aliases[node.value.id] != me
                ):
                    private.append(f"{path}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
            deps = set()
            for t in targets:
                parts = t.split(".")
                # importing a.b.c runs the package inits a and a.b unless the importer is inside
                for i in range(1, len(parts) + 1):
                    pkg = ".".join(parts[:i])
                    if not (me == pkg or me.startswith(pkg + ".")):
                        deps.add(pkg)
            edges[me] = deps - {me}
    return edges, private


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a module path (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.fixture(scope="module")
def project():
    return scan(REPO)


def test_every_kernel_module_imports_and_has_a_level():
    names = {m.name for m in pkgutil.iter_modules([str(REPO / "pallas_kernels")])}
    assert names == set(LEVELS), "classify new pallas_kernels modules in LEVELS"
    for name in sorted(names):
        importlib.import_module(f"pallas_kernels.{name}")


def test_no_private_name_of_another_module(project):
    _, private = project
    assert private == []


def test_no_import_circles(project):
    # the library's modules (experiments' registry imports its pipelines late by design)
    edges, _ = project
    library = {m: d for m, d in edges.items() if not m.startswith("experiments")}
    assert find_cycle(library) is None


def test_kernels_sit_between_layouts_and_ops_and_depend_on_formats_only(project):
    edges, _ = project
    for name, level in LEVELS.items():
        for dep in edges[f"pallas_kernels.{name}"]:
            if dep.startswith("pallas_kernels."):
                assert LEVELS[dep.split(".")[1]] <= level, f"{name} ({level}) imports {dep}"
            elif dep.startswith("trace_jax"):
                assert dep in ("trace_jax", "trace_jax.fp4") or dep.startswith("trace_jax.fp4.")


def test_the_checks_find_what_they_look_for(tmp_path):
    # a private import, a private attribute read, and a circle through a package init
    pkg = tmp_path / "pallas_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pallas_kernels.b import _helper\n")
    (pkg / "b.py").write_text("def f():\n    from trace_jax import rollout\n")
    (pkg / "c.py").write_text("from pallas_kernels import a as mod\nx = mod._y\n")
    rollout = tmp_path / "trace_jax" / "rollout"
    rollout.mkdir(parents=True)
    (tmp_path / "trace_jax" / "__init__.py").write_text("")
    (rollout / "__init__.py").write_text("from trace_jax.rollout import engine\n")
    (rollout / "engine.py").write_text("import pallas_kernels.a\n")
    edges, private = scan(tmp_path, ("pallas_kernels", "trace_jax"))
    found = [p.split(": ")[1] for p in private]
    assert found == ["pallas_kernels.b._helper", "pallas_kernels.a._y"]
    cycle = find_cycle(edges)
    assert cycle is not None and "trace_jax.rollout" in cycle and "pallas_kernels.b" in cycle
    (rollout / "__init__.py").write_text("")  # the package init no longer imports the engine
    assert find_cycle(scan(tmp_path, ("pallas_kernels", "trace_jax"))[0]) is None
