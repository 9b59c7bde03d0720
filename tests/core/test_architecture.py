"""The shape of core's code (issue 17): no import circle, no reach into another module's
private names. Both read the source (ast), so they see imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "packages" / "core" / "src" / "tierwise"
SOURCES = sorted(REPO.glob("packages/*/src/*/**/*.py"))
ENGINE_OWNERS = {CORE / "runtime" / "engine.py"}
"""Modules allowed to read the engine's private attributes (it is their ``self``)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, me: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module, names) of every import that runs (anywhere but under ``if TYPE_CHECKING``)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = me if is_package else me.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    package = package.rsplit(".", 1)[0]
                base = f"{package}.{base}" if base else package
            found.append((base, [alias.name for alias in node.names]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def core_import_graph() -> dict[str, set[str]]:
    """Module -> the core modules importing it runs (parent packages included: importing
    ``tierwise.runtime.residency.rcache`` runs ``tierwise/runtime/__init__.py`` first)."""
    paths = {_module_name(p, CORE): p for p in CORE.rglob("*.py")}
    graph = {}
    for me, path in paths.items():
        deps = set()
        for module, names in _imported_names(
            ast.parse(path.read_text()), me, path.name == "__init__.py"
        ):
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in paths] or [module]
            for target in targets:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    # a module's own parent packages are already running when it runs
                    if prefix in paths and prefix != me and not me.startswith(prefix + "."):
                        deps.add(prefix)
        graph[me] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_core_imports_form_no_circle():
    graph = core_import_graph()
    assert (
        "tierwise.runtime.engine" in graph["tierwise.runtime.setup.pipeline"]
    )  # the walk sees real edges
    assert (
        "tierwise.planning.planner" in graph["tierwise.builtin"]
    )  # function-level imports included
    assert circles(graph) == []


def test_no_plugin_and_no_lower_layer_imports_the_train_app():
    """Model presets live in ``tierwise.model_presets`` (issue 30): the profiler and search
    plugins build their models from there, never from the ``tierwise train`` app."""
    offenders = []
    for path in SOURCES:
        root = REPO / "packages" / path.relative_to(REPO / "packages").parts[0] / "src"
        me = _module_name(path, root / path.relative_to(root).parts[0])
        if me == "tierwise.cli" or me.startswith("tierwise.train"):
            continue
        for module, _ in _imported_names(
            ast.parse(path.read_text()), me, path.name == "__init__.py"
        ):
            if module.startswith("tierwise.train"):
                offenders.append(f"{path.relative_to(REPO)} imports {module}")
    assert offenders == []


def _private_engine_reads(tree: ast.AST) -> list[str]:
    """``engine._x`` / ``self.engine._x`` (any name ending in ``engine``), dunders aside."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if name.lstrip("_").endswith("engine"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _private_imports(tree: ast.AST) -> list[str]:
    """``from x import _name`` (one module importing another's private name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    return found


def test_no_module_reads_the_engines_private_state():
    offenders = []
    for path in SOURCES:
        if path in ENGINE_OWNERS:
            continue
        for hit in _private_engine_reads(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(REPO)} {hit}")
    assert offenders == []


def test_no_module_imports_a_private_name_of_another():
    offenders = []
    for path in SOURCES:
        for hit in _private_imports(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(REPO)} {hit}")
    assert offenders == []


RUNTIME_COMPONENTS = ("residency", "access", "gradients", "optimizer", "tracing", "phases")
"""The engine's components (``Engine.<name>``; [Note: shared runtime state])."""


def _is_private(name: str) -> bool:
    """``_x``, not a dunder (``__x``) and not an enum-style sunder (``_x_``)."""
    return name.startswith("_") and not name.startswith("__") and not name.endswith("_")


def _private_reads_of_collaborators(tree: ast.AST) -> list[str]:
    """``self.x._y`` (a private attribute of an object this one holds: a collaborator) and
    ``gradients._y`` / ``engine.optimizer._y`` (through a name of a runtime component)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        owner = node.value
        held = (
            isinstance(owner, ast.Attribute)
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        )
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if held or name in RUNTIME_COMPONENTS:
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [hit for _, hit in sorted(found)]


def test_no_component_reads_a_collaborators_private_state():
    """Components share only what they declare ([Note: shared runtime state])."""
    offenders = []
    for path in SOURCES:
        for hit in _private_reads_of_collaborators(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(REPO)} {hit}")
    assert offenders == []


def test_the_engine_is_built_from_components_not_mixins():
    tree = ast.parse((CORE / "runtime" / "engine.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.bases == []
    assigned = {
        target.attr
        for node in ast.walk(engine)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    }
    assert set(RUNTIME_COMPONENTS) <= assigned


def test_the_collaborator_check_sees_what_it_refuses():
    tree = ast.parse(
        "def f(self, gradients, engine, state):\n"
        "    self.optimizer._early_hyper.clear()\n"
        "    gradients._no_sync = True\n"
        "    engine.residency._evictable()\n"
        "    return self._own, state._value_, self.x.__class__, self.x.public\n"
    )
    assert _private_reads_of_collaborators(tree) == [
        "line 2: self.optimizer._early_hyper",
        "line 3: gradients._no_sync",
        "line 4: engine.residency._evictable",
    ]


def test_the_source_checks_see_what_they_refuse():
    tree = ast.parse(
        "from tierwise.parallel.collectives import _all_gather\n"
        "def f(engine, x):\n"
        "    engine._steps += 1\n"
        "    x.engine._relayout_checked = True\n"
        "    return engine.__class__, engine.steps_taken\n"
    )
    assert _private_imports(tree) == [
        "line 1: from tierwise.parallel.collectives import _all_gather"
    ]
    assert _private_engine_reads(tree) == [
        "line 3: engine._steps",
        "line 4: x.engine._relayout_checked",
    ]


COLLECTIVES_LAYER = CORE / "parallel" / "collectives.py"
"""The one module that calls torch.distributed collectives ([Note: collectives on the group's
device])."""
_COLLECTIVE_NAMES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_gather_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
}


def _direct_collectives(tree: ast.AST) -> list[str]:
    """Uses of a torch.distributed collective: ``dist.x`` / ``torch.distributed.x`` (under any
    alias of torch.distributed) and ``from torch.distributed import x``."""
    aliases = {"torch.distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [
                f"line {node.lineno}: from torch.distributed import {a.name}"
                for a in node.names
                if a.name in _COLLECTIVE_NAMES
            ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _COLLECTIVE_NAMES:
            if ast.unparse(node.value) in aliases:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_only_the_collectives_layer_calls_torch_distributed_collectives():
    # every collective goes through tierwise.parallel.collectives, which puts its tensors on the
    # group's device: [Note: collectives on the group's device]
    found = {}
    for path in SOURCES:
        if path == COLLECTIVES_LAYER:
            continue
        calls = _direct_collectives(ast.parse(path.read_text()))
        if calls:
            found[str(path.relative_to(REPO))] = calls
    assert not found, found
    assert _direct_collectives(ast.parse(COLLECTIVES_LAYER.read_text()))  # it sees the layer's


def test_the_collective_check_sees_what_it_refuses():
    tree = ast.parse(
        "import torch.distributed as dist\n"
        "import torch.distributed\n"
        "from torch import distributed as d2\n"
        "from torch.distributed import all_reduce, get_rank\n"
        "def f(x, g):\n"
        "    dist.all_reduce(x)\n"
        "    torch.distributed.barrier()\n"
        "    d2.broadcast_object_list([x], src=0)\n"
        "    return dist.get_rank(), dist.ReduceOp.MAX, g.all_reduce(x)\n"
    )
    assert _direct_collectives(tree) == [
        "line 4: from torch.distributed import all_reduce",
        "line 6: dist.all_reduce",
        "line 7: torch.distributed.barrier",
        "line 8: d2.broadcast_object_list",
    ]


# [Note: core's layers]
# Each module has a layer; a module may import its own layer and the ones below, never one
# above, type-only imports (under ``if TYPE_CHECKING``) included. A module's layer is the one of
# the longest prefix below that names it; docs/architecture.md's tables list the same layers.
LAYERS: list[tuple[str, list[str]]] = [
    ("facts", ["_version", "precision", "units", "jsonable", "devices", "registry", "hf_compat"]),
    ("intent", ["config", "plan", "profile", "hardware", "model_presets", "probe"]),
    ("plugin interface", ["hookspecs", "protocols"]),
    ("data", ["chunks", "tiers", "parallel", "optim", "weights"]),
    ("planning", ["planning"]),
    ("plugin host", ["builtin", "plugins", "target"]),
    ("runtime state", ["runtime.index", "runtime.traffic", "runtime.phases"]),
    ("residency", ["runtime.residency"]),
    ("access", ["runtime.access"]),
    ("gradients", ["runtime.grads"]),
    ("step", ["runtime.step"]),
    ("activations", ["runtime.activations"]),
    ("layout", ["runtime.layout"]),
    ("engine", ["runtime.engine", "runtime.grad_delivery", "runtime.engine_pools"]),
    ("setup", ["runtime.setup", "runtime"]),
    ("entry points", ["api", "optimizer", "checkpoint", "pretrained", "integrations"]),
    ("apps", ["train", "cli", ""]),
]


def layer_of(module: str) -> int:
    name = module.removeprefix("tierwise").removeprefix(".")
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".") or prefix == "") and len(
                prefix
            ) > best:
                best, rank = len(prefix), i
    assert rank is not None, module
    return rank


def all_imports_graph() -> dict[str, set[str]]:
    """Like ``core_import_graph`` with type-only imports counted too."""
    paths = {_module_name(p, CORE): p for p in CORE.rglob("*.py")}
    graph = {}
    for me, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [(alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
                    for _ in range(node.level - 1):
                        package = package.rsplit(".", 1)[0]
                    base = f"{package}.{base}" if base else package
                found = [(base, [alias.name for alias in node.names])]
            else:
                continue
            for module, names in found:
                targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in paths] or [module]
                deps.update(t for t in targets if t in paths and t != me)
        graph[me] = deps
    return graph


def test_imports_point_down_the_layers():
    graph = all_imports_graph()
    upward = sorted(
        f"{me} ({LAYERS[layer_of(me)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
        for me, deps in graph.items()
        for dep in deps
        if layer_of(dep) > layer_of(me)
    )
    assert upward == []


def test_no_circle_with_type_only_imports():
    assert circles(all_imports_graph()) == []


def test_no_two_classes_share_a_name_across_the_project():
    """A name says what a class is: one class per name in every package (issue 35)."""
    where: dict[str, list[str]] = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_no_runtime_module_is_over_450_lines():
    """Small modules, each one part (issue 35): a runtime module that grows past this is
    doing several jobs and is split along its seams."""
    long = {
        str(path.relative_to(CORE)): n
        for path in (CORE / "runtime").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert long == {}


def test_architecture_md_lists_every_runtime_module():
    """docs/architecture.md's runtime table names every runtime module by its path."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    runtime = CORE / "runtime"
    missing = [
        str(path.relative_to(CORE.parent))
        for path in sorted(runtime.rglob("*.py"))
        if path.name != "__init__.py"
        and f"runtime/{path.relative_to(runtime)}" not in doc
        and f"`{path.name}`" not in doc
    ]
    assert missing == []
