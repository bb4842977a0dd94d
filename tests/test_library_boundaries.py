"""Library code never reads the environment: entry points (the CLI, the launchers, the benchmark
drivers) read it once and pass what they found in. Tested on the source, so a new reader fails
here rather than in a user's surprised job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import moeflow

SOURCE = Path(moeflow.__file__).parent
ENTRY_POINTS = ("cli.py", "__main__.py", "commands/", "training/launch.py", "distributed.py", "testbed/", "bench/")


def _reads_environment(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        reader = isinstance(node, ast.Attribute) and node.attr in {"environ", "getenv", "environb", "putenv"}
        if reader and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for alias in node.names if alias.name in {"environ", "getenv"}]
    return sorted(lines)


def test_library_modules_do_not_read_the_environment() -> None:
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        if relative.startswith(ENTRY_POINTS):
            continue
        offenders += [f"{relative}:{line}" for line in _reads_environment(ast.parse(path.read_text()))]
    assert not offenders, f"library modules read the environment: {offenders}"


def test_the_check_sees_a_reader() -> None:
    assert _reads_environment(ast.parse("import os\nx = os.environ.get('A')\ny = os.getenv('B')")) == [2, 3]


def _imports(path: Path, module: str) -> set[str]:
    """The moeflow modules ``module`` imports anywhere in its file: inside functions too, and under
    ``if TYPE_CHECKING:`` (an annotation that needs a module above is a dependency on it all the same)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "moeflow"}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a ``from a import b`` of a submodule b
    counts as importing a.b, of a name as importing a)."""
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {target for name in _imports(path, module) if (target := resolve(name)) not in (None, module)}
            for module, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_moeflow_has_no_import_cycle() -> None:
    """Bottom to top, a module imports only what sits below it, lazy imports inside functions
    included (a lazy import that closes a cycle is still a cycle)."""
    assert import_cycles(import_graph(SOURCE)) == []


ARCHITECTURE = Path(__file__).parent.parent / "docs" / "design" / "architecture.md"


def read_layers(page: str) -> tuple[tuple[str, ...], ...]:
    """The table of layers, bottom to top, from the architecture page (the rows between its
    ``layers`` markers): each row's backticked packages in its second column."""
    rows = page.split("<!-- layers: start -->")[1].split("<!-- layers: end -->")[0].strip().splitlines()[2:]
    return tuple(tuple(re.findall(r"`([\w.]+)`", row.split("|")[2])) for row in rows)


LAYERS = read_layers(ARCHITECTURE.read_text())
"""moeflow's layers, bottom to top: a package imports only from the layers below its own."""


def package_of(module: str) -> str:
    """The top-level package (or top-level module) ``module`` belongs to; ``moeflow`` for the
    package's own ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(package: str) -> int:
    matches = [index for index, packages in enumerate(LAYERS) if package in packages]
    if not matches:
        raise AssertionError(f"moeflow.{package} has no layer: add it to the table in docs/design/architecture.md")
    return matches[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level package -> the other top-level packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets if package_of(t) != source)
    return packages


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import whose target's package is not in a layer below the importer's (a neighbour in
    the same layer counts: a layer's packages do not import each other)."""
    def points_up(module: str, target: str) -> bool:
        source, destination = package_of(module), package_of(target)
        return source != destination and layer_of(destination) >= layer_of(source)

    return [f"{module} -> {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if points_up(module, target)]


def test_every_package_has_one_layer() -> None:
    packages = sorted(package_graph(import_graph(SOURCE)))
    for package in packages:
        layer_of(package)  # raises, naming the package, where it has no row
    listed = [package for layer in LAYERS for package in layer]
    assert len(listed) == len(set(listed)), "a package appears in two layers"
    assert set(listed) == set(packages), sorted(set(listed) ^ set(packages))


def test_no_package_is_in_an_import_cycle() -> None:
    assert import_cycles(package_graph(import_graph(SOURCE))) == []


def test_packages_import_only_from_the_layers_below() -> None:
    assert upward_imports(import_graph(SOURCE)) == []


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    package = tmp_path / "moeflow"
    (package / "moe").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "moe" / "__init__.py").write_text("")
    (package / "config.py").write_text("def f():\n    from moeflow.moe.layer import MoELayer\n")
    (package / "moe" / "layer.py").write_text("from moeflow.config import f\n")
    (package / "comm.py").write_text("from moeflow.perf import rate\n")  # a neighbour in the same layer
    (package / "perf.py").write_text("")
    assert upward_imports(import_graph(package)) == ["moeflow.comm -> moeflow.perf",
                                                     "moeflow.config -> moeflow.moe.layer"]
    assert import_cycles(package_graph(import_graph(package))) == [["config", "moe"]]


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path: Path) -> None:
    package = tmp_path / "moeflow"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from moeflow.sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from moeflow import a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moeflow import d\n")
    (package / "d.py").write_text("from moeflow import c\n")
    graph = import_graph(package)
    assert "moeflow.d" in graph["moeflow.c"]
    assert sorted(import_cycles(graph)) == [["moeflow.a", "moeflow.sub.b"], ["moeflow.c", "moeflow.d"]]


def test_the_layers_are_read_from_the_page() -> None:
    assert LAYERS[0][0] == "config" and LAYERS[-1] == ("__main__",)
    assert layer_of("core") < layer_of("comm") < layer_of("kernels") < layer_of("parallel") < layer_of("sim") \
        < layer_of("moe") < layer_of("training") < layer_of("cli")


def test_the_layer_is_glue() -> None:
    """The layer assembles what the other modules decide: it stays short, its forward reads as the
    data flow on one screen, and it never asks which schedule or placement it runs."""
    path = SOURCE / "moe" / "layer.py"
    tree = ast.parse(path.read_text())
    assert len(path.read_text().splitlines()) <= 400
    (forward,) = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == "_forward"]
    assert forward.end_lineno - forward.lineno + 1 <= 45
    name_tests = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare) and any(
        isinstance(side, ast.Attribute) and side.attr == "name" for side in [node.left, *node.comparators])]
    assert not name_tests, f"layer.py tests a schedule's name on lines {name_tests}"


def test_the_simulator_and_the_joint_planner_run_without_torch() -> None:
    """A 2,048-rank plan search reads the technique records, whose run classes load only when made:
    nothing imports torch (nor so torch.distributed)."""
    import subprocess
    import sys

    script = ("import sys\nfrom moeflow.sim import load_cluster, load_model\nfrom moeflow.sim.planner import search\n"
              "import moeflow.perf, moeflow.parallel.registry\n"
              "search(load_cluster('tutel-a100').resized(256, 8), load_model(None).with_overrides(layers=2), top=1)\n"
              "print(sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]"


def test_only_the_bench_command_imports_the_benchmarks() -> None:
    """The benchmark drivers are entry points: library helpers live in the library (``print_json``
    in :mod:`moeflow.files`), and only ``moeflow bench`` (each benchmark's parser) reaches into ``moeflow.bench``."""
    graph = import_graph(SOURCE)
    reaching = sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                      if package_of(target) == "bench"
                      and not module.startswith(("moeflow.bench", "moeflow.commands.bench")))
    assert reaching == []


def test_the_package_top_stays_small() -> None:
    """Modules live in the package of the layer they serve: the top of ``src/moeflow`` keeps only
    settings, entry points and the few helpers every layer shares."""
    top = sorted(path.name for path in SOURCE.glob("*.py"))
    assert len(top) <= 15, top
