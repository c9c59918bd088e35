"""The package's layering (docs/design.md "Layout"): imports run one way, ground <- run <- data, model
<- train <- ops <- cli, with no circle. Read from the source with `ast`, every import counted (top-level,
lazy inside a function, and type-only), so a new module cannot quietly reach up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "andrea_core"
GROUND = {
    "config",
    "model_config",
    "checkpoint",
    "signals",
    "pdeathsig",
    "command",
    "bounded",
    "untrusted",
    "atomic",
    "faults",
    "poll",
    "document",
    "oom",
}
# What each layer may import, besides itself.
MAY_IMPORT = {
    "ground": {"ground"},
    "run": {"ground"},
    "data": {"ground", "run"},
    "model": {"ground"},
    "train": {"ground", "run", "data", "model"},
    "ops": {"ground", "run", "data", "model", "train"},
    "top": {"ground", "run", "data", "model", "train", "ops"},
}


def layer(module: str) -> str:
    """`andrea_core.run.lock` -> "run"; the ground modules and the top (cli, __main__) by name."""
    parts = module.split(".")[1:]
    if not parts:
        return "top"
    if parts[0] in MAY_IMPORT and parts[0] not in ("ground", "top"):
        return parts[0]
    if parts[0] in GROUND:
        return "ground"
    if parts[0] in ("cli", "__main__"):
        return "top"
    raise AssertionError(f"{module}: in no layer of docs/design.md's table; put it in one")


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The andrea_core modules `path` imports: `from andrea_core.x import y` counts as andrea_core.x.y
    when that is a module (a submodule import), else as andrea_core.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("andrea_core")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("andrea_core"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found - {"andrea_core"}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(p, set(mods)) for m, p in mods.items()}


def test_every_import_runs_down_the_layers():
    wrong = []
    for module, deps in graph().items():
        if module.endswith("__init__") or module == "andrea_core":
            continue
        mine = layer(module)
        for dep in sorted(deps):
            theirs = layer(dep)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module} ({mine}) imports {dep} ({theirs})")
    assert not wrong, "imports that run up the layers:\n" + "\n".join(wrong)


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join(path[path.index(d) :] + [d]) if d in path else f"{m} -> {d}")
            elif d in g and state.get(d) is None:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(g):
        if state.get(m) is None:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", ["run", "data", "model", "train", "ops"])
def test_package_inits_are_empty(package):
    """No re-exports and no shims: a module is imported from its one home (a docstring at most)."""
    body = ast.parse((PACKAGE / package / "__init__.py").read_text()).body
    assert all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def test_andrea_core_never_imports_prefect():
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "prefect" for n in names), f"{module} imports Prefect"


def test_each_module_says_what_it_is_for():
    """Each module opens with a docstring (as llm.c's files open with what they implement)."""
    missing = [
        m
        for m, p in modules().items()
        if p.name != "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert not missing, f"modules without an opening docstring: {missing}"
