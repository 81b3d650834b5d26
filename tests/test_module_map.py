"""docs/architecture.md's module map is the one generated from the module docstrings
(tests/module_map.py): every module of the package is in it, described by its own docstring."""

from __future__ import annotations

import module_map


def test_every_module_has_a_docstring_and_the_map_is_current():
    undocumented = [p.relative_to(module_map.PACKAGE).as_posix() for p in module_map.modules()
                    if not module_map.summary(p)]
    assert not undocumented, f"modules without a docstring: {undocumented}"
    committed = module_map.committed()
    assert committed is not None, "docs/architecture.md lost the module map's marker lines"
    listed = {line.split("`")[1] for line in committed.splitlines() if line.startswith("| `")}
    assert listed == {p.relative_to(module_map.PACKAGE).as_posix() for p in module_map.modules()}
    assert committed == module_map.generate().rstrip("\n") + "\n", \
        "the module map is not the generated one: run python tests/module_map.py"
