"""The package's import graph: no cycles, contracts owned by leaf modules, the jitted step imported
only where a step is built. Read from the source with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "turnsight_jax"
# Modules that build or run a train step (the trainer, its warm-start's optimizer, the dry run).
STEP_IMPORTERS = {"turnsight_jax.train", "turnsight_jax.sft", "turnsight_jax.rl.plan"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """Package modules that `path` imports anywhere (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when that is a module
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in modules}
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for p in PKG.rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    for name, deps in graph.items():  # `from pkg import mod` names pkg too: not an edge to one's own parents
        deps.discard(name)
        deps.difference_update({d for d in deps if name.startswith(d + ".")})
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph) > 40  # the whole package was read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_step_builders_import_the_jitted_step():
    importers = {n for n, deps in _graph().items() if "turnsight_jax.rl.step" in deps}
    assert importers <= STEP_IMPORTERS, importers - STEP_IMPORTERS


def test_contracts_live_in_leaf_modules():
    graph = _graph()
    # the typed step configs and the error type import nothing heavier than each other
    assert graph["turnsight_jax.errors"] == set()
    assert graph["turnsight_jax.chat.hindsight_template"] == {"turnsight_jax.errors"}
    assert graph["turnsight_jax.rl.config"] <= {"turnsight_jax.errors", "turnsight_jax.chat.hindsight_template"}
    # the batch contract does not import the step
    assert "turnsight_jax.rl.step" not in graph["turnsight_jax.rl.batch"]
    for gone in ("runtime", "train_step", "batching", "teacher", "views", "plan", "sharding", "advantages",
                 "logprobs"):
        assert not (PKG / f"{gone}.py").exists(), gone
