"""The package's import graph: no cycles, contracts owned by leaf modules, the jitted step imported
only where a step is built. Read from the source with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "turnsight_jax"
# Modules that build or run a train step (the trainer, its warm-start's optimizer, the dry run).
STEP_IMPORTERS = {"turnsight_jax.train", "turnsight_jax.sft", "turnsight_jax.rl.plan", "turnsight_jax.rl.supervised"}


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


DOC = PKG.parent / "docs" / "architecture.md"
def _layers() -> list[tuple[str, list[str]]]:
    """[(layer name, module prefixes)], lowest first, from docs/architecture.md's table."""
    text = DOC.read_text()
    table = text.split("<!-- layers: read by tests/test_package_layout.py -->", 1)[1]
    table = table.split("<!-- end of the layers -->")[0]
    rows = [r for r in table.strip().splitlines()[2:]]
    return [(r.split("|")[1].strip(), [c.strip(" `") for c in r.split("|")[2].split(",")]) for r in rows]


def _layer_of(module: str, layers) -> tuple[int, str]:
    """(index, layer name) of a module (`turnsight_jax.` dropped): its longest matching prefix."""
    name = module.removeprefix("turnsight_jax.")
    best = None
    for i, (layer, prefixes) in enumerate(layers):
        for p in prefixes:
            hit = name == p.rstrip(".") or (p.endswith(".") and name.startswith(p))
            if hit and (best is None or len(p) > best[0]):
                best = (len(p), i, layer)
    assert best is not None, f"{module} is in no layer of docs/architecture.md's table"
    return best[1], best[2]


def test_no_module_imports_a_layer_above_its_own():
    layers = _layers()
    assert [name for name, _ in layers][:2] == ["foundation", "models"] and len(layers) == 9
    graph = _graph()
    upward = set()
    for module, deps in graph.items():
        if module == "turnsight_jax":
            continue
        own = _layer_of(module, layers)[0]
        for dep in deps:
            if dep != "turnsight_jax" and _layer_of(dep, layers)[0] > own:
                upward.add((module.removeprefix("turnsight_jax."), dep.removeprefix("turnsight_jax.")))
    # A module that needs something of a higher layer takes it through a registry of its own
    # layer (rl.methods, rl.auxiliaries, rl.views, ...), or the piece moves down.
    assert not upward, f"upward imports: {sorted(upward)}"


def test_no_core_module_imports_a_method():
    """The redesign's goal, issue 60: no core module (foundation, models, chat, environments,
    rollout, core, evaluation) imports a method module, at module level or inside a function; the
    methods reach the core through its registries (rl.methods, rl.auxiliaries, rl.views, ...)."""
    layers = _layers()
    core_layers = {"foundation", "models", "chat", "environments", "rollout", "core", "evaluation"}
    into_methods = {(m.removeprefix("turnsight_jax."), d.removeprefix("turnsight_jax."))
                    for m, deps in _graph().items() if m != "turnsight_jax" and _layer_of(m, layers)[1] in core_layers
                    for d in deps if d != "turnsight_jax" and _layer_of(d, layers)[1] == "methods"}
    assert not into_methods, sorted(into_methods)


def test_the_layer_check_catches_an_upward_import():
    layers = _layers()
    assert _layer_of("turnsight_jax.rl.step", layers)[1] == "core"
    assert _layer_of("turnsight_jax.judge.__main__", layers)[1] == "entry points"
    assert _layer_of("turnsight_jax.judge.method", layers)[1] == "methods"
    assert _layer_of("turnsight_jax.models.qwen3", layers)[0] < _layer_of("turnsight_jax.rollout.engine", layers)[0]


# Issue 60's acceptance 3: the trainer, the step, the batch and the config name no method (code,
# keys, comments and messages alike); the methods reach them through the registries. Core words
# that merely contain a method's name are not counted (`ppo_epochs`: the PPO-style epochs over a
# batch, a knob of every method), nor the step auxiliaries' names ("critic", "prm"; rl.auxiliaries),
# which the FLOP counter's parts name, nor the teacher kinds ("hindsight", "privileged":
# rl.methods.TEACHER_KINDS, what a teacher view shows, on which the step's gap and coverage
# branch; the privileged kind's settings are the `privileged.*` section).
CORE_FILES = ("train.py", "rl/step.py", "rl/batch.py", "config.py")
CORE_WORDS = ("ppo_epochs",)


def _method_names() -> list[str]:
    """The built-in methods' names (methods, rollout controllers, config sections), less the core's."""
    import turnsight_jax.methods  # noqa: F401
    from turnsight_jax.rl import methods as registry
    from turnsight_jax.rl.config import CONFIG_SECTIONS

    from turnsight_jax.rl.auxiliaries import AUXILIARIES
    from turnsight_jax.rl.methods import TEACHER_KINDS

    core = {"grpo", "matchtir", "toolrl", "turnsight", "sampler"}
    # the step auxiliaries ("critic", "prm", "retrospective") are pieces the core loops over
    # (rl.auxiliaries), named for what they are, not methods; their config sections likewise
    return sorted((set(registry.METHODS) | set(registry.ROLLOUTS) | set(CONFIG_SECTIONS)) - core - set(AUXILIARIES)
                  - set(TEACHER_KINDS))


def _named(text: str, names) -> dict[str, int]:
    import re

    for word in CORE_WORDS:
        text = re.sub(re.escape(word), " ", text, flags=re.I)
    counts = {n: len(re.findall(r"(?<![A-Za-z0-9])" + re.escape(n) + r"(?![A-Za-z0-9])", text, flags=re.I))
              for n in names}
    return {n: c for n, c in counts.items() if c}


def test_the_core_files_name_no_method():
    names = _method_names()
    assert {"bar", "slim", "akbe", "appo", "orchard", "sdpo", "ppo", "gae"} <= set(names)
    found = {f: _named((PKG / f).read_text(), names) for f in CORE_FILES}
    assert found == {f: {} for f in CORE_FILES}
    # the counter counts: a method's name in code and in a key, not inside a longer core word
    assert _named("if cfg.bar.cap: run_bar(); ppo_epochs = 2; sdpo_coef; PPO", names) == {"bar": 2, "sdpo": 1, "ppo": 1}
