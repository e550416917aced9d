"""The package's layers: a module imports only its own layer and the layers below it.

Every import counts, a function-local one included (a cycle in disguise), except those under
``if TYPE_CHECKING:``, which name a type for annotations and run nothing (``weights`` names the
shard plan ``parallel`` defines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import lora_pin

PACKAGE = Path(lora_pin.__file__).parent

# Lowest first; a module belongs to the layer of the longest prefix naming it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("lora_pin._core", "lora_pin.errors", "lora_pin.args", "lora_pin.unloading", "lora_pin.routing"),
    ("lora_pin.weights",),
    ("lora_pin.ops",),
    ("lora_pin.parallel",),
    ("lora_pin.model", "lora_pin.metrics"),
    (
        "lora_pin.serve",
        "lora_pin.cli",
        "lora_pin.demo",
        "lora_pin.fixtures",
        "lora_pin.parallel_fixtures",
        "lora_pin._testing",
        "lora_pin.__main__",
        "lora_pin",
    ),
)


def layer_of(module: str) -> int:
    """The layer of ``module`` (a dotted name under ``lora_pin``).

    Raises:
        AssertionError: no layer names it (a new module must be placed in ``LAYERS``).
    """
    best: tuple[int, int] | None = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            named = module == prefix or module.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_submodule(name: str) -> bool:
    """Whether ``name`` is a module of the package (the native ``_core`` by its stub)."""
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return any(path.with_suffix(s).exists() for s in (".py", ".pyi")) or (path / "__init__.py").exists()


def imported(tree: ast.Module, typing: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``lora_pin`` module ``tree`` imports outside ``if TYPE_CHECKING:``
    (inside too when ``typing``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "lora_pin"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lora_pin":
            assert node.level == 0, f"line {node.lineno}: a relative import"
            for alias in node.names:
                # `from lora_pin import _core` imports the module lora_pin._core, not the package's face.
                full = f"{node.module}.{alias.name}"
                out.append((node.lineno, full if is_submodule(full) else node.module))
    return out


def test_no_module_imports_a_higher_layer() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        level = layer_of(module)
        for line, target in imported(ast.parse(path.read_text(), str(path))):
            if layer_of(target) > level:
                wrong.append(f"{module}:{line} imports {target}")
    assert not wrong, "lower layers import higher ones:\n" + "\n".join(wrong)


def test_the_check_sees_a_function_local_import_of_a_higher_layer() -> None:
    tree = ast.parse("def f():\n    from lora_pin.model.manager import LoRAManager\n")
    assert imported(tree) == [(2, "lora_pin.model.manager")]
    assert layer_of("lora_pin.model.manager") > layer_of("lora_pin.parallel.group")
    typing_only = ast.parse("if TYPE_CHECKING:\n    from lora_pin.parallel import ShardPlan\n")
    assert imported(typing_only) == []
    assert imported(typing_only, typing=True) == [(2, "lora_pin.parallel")]


# Pairs of modules known to import each other, each with the work that removes it. Empty when none.
KNOWN_MUTUAL_IMPORTS: frozenset[frozenset[str]] = frozenset(
    {
        # The weights helper of issue 34 removes this one (weights/dora.py <-> weights/hosted.py).
        frozenset({"lora_pin.weights.dora", "lora_pin.weights.hosted"}),
    }
)


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``lora_pin`` modules it imports, those under ``TYPE_CHECKING`` included: two modules
    that name each other's types know each other as much as two that call each other."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        found = imported(ast.parse(path.read_text(), str(path)), typing=True)
        graph[module] = {t for _, t in found if t != module}
    return graph


def mutual_imports(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The pairs of modules of ``graph`` that import each other."""
    return {frozenset({m, t}) for m, targets in graph.items() for t in targets if m in graph.get(t, ())}


def test_no_two_modules_import_each_other() -> None:
    found = mutual_imports(import_graph())
    unexpected = sorted(" <-> ".join(sorted(pair)) for pair in found - KNOWN_MUTUAL_IMPORTS)
    assert not unexpected, "modules that import each other (a cycle; one should not know the other):\n" + (
        "\n".join(unexpected)
    )


def test_the_check_sees_two_modules_importing_each_other() -> None:
    graph = {"lora_pin.x": {"lora_pin.y"}, "lora_pin.y": {"lora_pin.x", "lora_pin.z"}, "lora_pin.z": set()}
    assert mutual_imports(graph) == {frozenset({"lora_pin.x", "lora_pin.y"})}
