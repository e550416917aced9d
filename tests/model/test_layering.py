"""The package's layers: a module imports only its own layer and the layers below it, and no two modules
import each other.

Every import counts, a function-local one included (a cycle in disguise). So does every name a module
gives a type: an import under ``if TYPE_CHECKING:`` and a module named in a string annotation run nothing,
yet a lower layer that names a higher one's types depends on it all the same (``weights`` once named the
shard plan ``parallel`` defined; the plan type now lives in ``weights``).
"""

from __future__ import annotations

import ast
import re
from itertools import combinations
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


# A dotted ``lora_pin`` name inside a string annotation (``"lora_pin.parallel.sharding.ShardPlan"``).
_NAMED = re.compile(r"\blora_pin(?:\.\w+)+")


def imported(tree: ast.Module, type_level: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``lora_pin`` module ``tree`` imports outside ``if TYPE_CHECKING:``;
    with ``type_level``, also those it imports under it and those its string annotations name."""
    skipped: set[int] = set()
    if not type_level:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if type_level:
            out += [(line, named) for line, named in _annotated(node)]
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "lora_pin"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lora_pin":
            assert node.level == 0, f"line {node.lineno}: a relative import"
            for alias in node.names:
                # `from lora_pin import _core` imports the module lora_pin._core, not the package's face.
                full = f"{node.module}.{alias.name}"
                out.append((node.lineno, full if is_submodule(full) else node.module))
    return out


def _annotated(node: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of each ``lora_pin`` module a string annotation on ``node`` names (the longest
    prefix of the dotted name that is a module)."""
    annotations: list[ast.expr | None] = []
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        annotations += [a.annotation for a in every if a is not None]
        annotations.append(node.returns)
    elif isinstance(node, ast.AnnAssign):
        annotations.append(node.annotation)
    out = []
    for annotation in annotations:
        for part in ast.walk(annotation) if annotation is not None else ():
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                for name in _NAMED.findall(part.value):
                    parts = name.split(".")
                    found = next(
                        (
                            ".".join(parts[:n])
                            for n in range(len(parts), 0, -1)
                            if is_submodule(".".join(parts[:n]))
                        ),
                        "lora_pin",
                    )
                    out.append((part.lineno, found))
    return out


def _imports(type_level: bool) -> dict[str, list[tuple[int, str]]]:
    """Every module of the package and what it imports (see :func:`imported`)."""
    return {
        module_name(path): imported(ast.parse(path.read_text(), str(path)), type_level)
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_no_module_imports_a_higher_layer() -> None:
    wrong = []
    for module, targets in _imports(type_level=False).items():
        level = layer_of(module)
        for line, target in targets:
            if layer_of(target) > level:
                wrong.append(f"{module}:{line} imports {target}")
    assert not wrong, "lower layers import higher ones:\n" + "\n".join(wrong)


def test_no_module_names_a_type_of_a_higher_layer() -> None:
    wrong = []
    for module, targets in _imports(type_level=True).items():
        level = layer_of(module)
        for line, target in targets:
            if layer_of(target) > level:
                wrong.append(f"{module}:{line} names {target}")
    assert not wrong, "lower layers name higher ones' types:\n" + "\n".join(wrong)


def mutual_pairs(imports: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The pairs ``(a, b)``, ``a < b``, of modules of ``imports`` (module -> what it imports) that import
    each other."""
    return {(a, b) for a, b in combinations(sorted(imports), 2) if b in imports[a] and a in imports[b]}


def test_no_two_modules_import_each_other() -> None:
    imports = {m: {t for _, t in targets} for m, targets in _imports(type_level=True).items()}
    pairs = mutual_pairs(imports)
    assert not pairs, f"modules importing each other (one should not know the other): {sorted(pairs)}"


def test_the_check_sees_two_modules_importing_each_other() -> None:
    imports = {"lora_pin.x": {"lora_pin.y"}, "lora_pin.y": {"lora_pin.x", "lora_pin.z"}, "lora_pin.z": set()}
    assert mutual_pairs(imports) == {("lora_pin.x", "lora_pin.y")}


def test_the_check_sees_a_function_local_import_of_a_higher_layer() -> None:
    tree = ast.parse("def f():\n    from lora_pin.model.manager import LoRAManager\n")
    assert imported(tree) == [(2, "lora_pin.model.manager")]
    assert layer_of("lora_pin.model.manager") > layer_of("lora_pin.parallel.group")
    typing_only = ast.parse("if TYPE_CHECKING:\n    from lora_pin.parallel import ShardPlan\n")
    assert imported(typing_only) == []
    assert imported(typing_only, type_level=True) == [(2, "lora_pin.parallel")]


def test_the_check_sees_a_module_named_in_a_string_annotation() -> None:
    tree = ast.parse('def f(plan: "lora_pin.parallel.sharding.GroupShard | None") -> None: ...\n')
    assert imported(tree) == []
    assert imported(tree, type_level=True) == [(1, "lora_pin.parallel.sharding")]
    assert layer_of("lora_pin.parallel.sharding") > layer_of("lora_pin.weights.building")


# The manager's parts a server must not reach past it for (its own public methods say what it may do).
_MANAGER_INSIDES = {"registry", "residency", "host", "pool"}


def reaches_past_the_manager(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, expression)`` of every read of a manager's insides in ``tree``: ``<x>.registry``,
    ``.residency``, ``.host``, ``.pool`` or a private attribute of an expression naming a manager (a name
    or attribute ending in ``manager`` or ``_lora``), and any ``.residency`` at all."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value)
        on_manager = owner.endswith(("manager", "_lora"))
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if node.attr == "residency" or (on_manager and (node.attr in _MANAGER_INSIDES or private)):
            out.append((node.lineno, ast.unparse(node)))
    return sorted(out)


def test_serve_goes_through_the_managers_public_api() -> None:
    wrong = []
    for path in sorted((PACKAGE / "serve").rglob("*.py")):
        for line, expr in reaches_past_the_manager(ast.parse(path.read_text(), str(path))):
            wrong.append(f"{module_name(path)}:{line} reads {expr}")
    assert not wrong, "serve/ reaches past the manager:\n" + "\n".join(wrong)


def test_the_check_sees_a_server_reaching_past_the_manager() -> None:
    tree = ast.parse(
        "self.manager.registry.unload(n)\nmanager.residency.lock\nself._lora._loads\n"
        "self.registry = CollectorRegistry()\nmanager.placement()\n"
    )
    assert reaches_past_the_manager(tree) == [
        (1, "self.manager.registry"),
        (2, "manager.residency"),
        (3, "self._lora._loads"),
    ]


# The LoRA layers and what they may take from ops/: the backends, the segments' type and errors, and the
# experts' row grouping (routing, not a kernel). Every delta runs through the model's backend.
_LAYER_MODULES = ("lora_pin.model.layers", "lora_pin.model.parallel_layers", "lora_pin.model.experts")
_LAYER_MAY_TAKE = {
    "lora_pin.ops": {"OpArgumentError", "KernelMeta"},
    "lora_pin.ops.backends": {"LoRABackend", "backend_for"},
    "lora_pin.ops.experts": {"expert_segments"},
}


def ops_taken(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, "module.name")`` of every name ``tree`` imports from ``lora_pin.ops`` and its modules
    (``import lora_pin.ops...`` as ``module.*``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lora_pin.ops"):
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, f"{a.name}.*") for a in node.names if a.name.startswith("lora_pin.ops")]
    return out


def test_the_lora_layers_run_every_delta_through_the_backend() -> None:
    wrong = []
    for module in _LAYER_MODULES:
        path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        source = path.read_text()
        for line, taken in ops_taken(ast.parse(source, str(path))):
            owner, _, name = taken.rpartition(".")
            if name not in _LAYER_MAY_TAKE.get(owner, set()):
                wrong.append(f"{module}:{line} takes {taken}")
        for word in ("device.type", "is_compiling"):
            if word in source:
                wrong.append(f"{module}: {word} (a layer never branches on the device)")
    assert not wrong, "a LoRA layer reaches past its backend:\n" + "\n".join(wrong)


def test_the_check_sees_a_layer_calling_an_op() -> None:
    tree = ast.parse("from lora_pin.ops.experts import expert_lora_delta_\nimport lora_pin.ops.custom_ops\n")
    assert sorted(ops_taken(tree)) == [
        (1, "lora_pin.ops.experts.expert_lora_delta_"),
        (2, "lora_pin.ops.custom_ops.*"),
    ]
