"""The layering, written once and checked three ways: the package dependencies each `pyproject.toml` declares
(the source of truth), the dependency table of docs/architecture.md and the imports of the code agree.

- no cycle between modules (imports inside functions count);
- a package imports only the mmfsdp packages its pyproject declares (`config` and `ckpt` at the bottom;
  `parallel` on `config`; `model` on `config`, `parallel` and `ckpt`; `data` on `config`; `train` on all), and
  it imports each of them (a declared dependency nothing uses is a stale line);
- the "depends on" column of docs/architecture.md's package map names exactly each pyproject's dependencies.
"""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted(ROOT.glob("packages/*/src")), ROOT / "apps" / "train" / "src"]
PYPROJECTS = {path.parent.name: path for path in [*ROOT.glob("packages/*/pyproject.toml"), ROOT / "apps" / "train" / "pyproject.toml"]}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _requirement_name(requirement: str) -> str:
    """`torch>=2.11` -> `torch`, `mistral-common[opencv]>=1.8` -> `mistral-common` (PEP 503-normalised)."""
    name = re.match(r"[A-Za-z0-9_.\-]+", requirement.strip()).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> dict[str, set[str]]:
    """package (`config`, ..., `train`) -> the distributions its pyproject's `[project] dependencies` name, with
    `mmfsdp-<package>` shortened to `<package>`."""
    out = {}
    for package, path in PYPROJECTS.items():
        names = {_requirement_name(r) for r in tomllib.loads(path.read_text())["project"]["dependencies"]}
        out[package] = {name.removeprefix("mmfsdp-") for name in names}
    return out


def allowed() -> dict[str, set[str]]:
    """What each package may import from the others: the mmfsdp packages its pyproject declares."""
    return {package: deps & set(PYPROJECTS) for package, deps in declared_dependencies().items()}


def documented_dependencies() -> dict[str, set[str]]:
    """package -> the names in the "depends on" column of docs/architecture.md's package map."""
    out = {}
    for line in ARCHITECTURE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not (match := re.fullmatch(r"`(?:packages|apps)/(\w+)`", cells[0])):
            continue
        out[match.group(1)] = {_requirement_name(name) for name in cells[3].split(",") if name.strip()}
    return out


def _modules() -> dict[str, Path]:
    modules = {}
    for source in SOURCES:
        for path in source.rglob("*.py"):
            parts = list(path.relative_to(source).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its file (a name resolves to its longest known prefix)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
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
                    components.append(sorted(component))
    return components


def test_the_graph_is_read():
    graph = _graph()
    assert "mmfsdp.train.trainer" in graph and "mmfsdp.model.training_forward" in graph
    assert "mmfsdp.model.loss" in graph["mmfsdp.model.training_forward"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_no_package_imports_one_it_does_not_declare():
    may = allowed()
    assert set(may) == {"config", "parallel", "model", "data", "ckpt", "train"}, may
    wrong = []
    for module, imported in _graph().items():
        package = _package(module)
        for other in imported:
            if _package(other) != package and _package(other) not in may[package]:
                wrong.append(f"{module} imports {other} ({package}'s pyproject does not declare mmfsdp-{_package(other)})")
    assert wrong == []


def test_every_declared_package_dependency_is_imported():
    used: dict[str, set[str]] = {package: set() for package in PYPROJECTS}
    for module, imported in _graph().items():
        used[_package(module)] |= {_package(other) for other in imported} - {_package(module)}
    assert used == allowed(), "a pyproject declares an mmfsdp package its code never imports (or the reverse)"


def test_the_architecture_table_names_each_pyprojects_dependencies():
    documented = documented_dependencies()
    assert set(documented) == set(PYPROJECTS), f"docs/architecture.md's package map lists {sorted(documented)}"
    for package, names in declared_dependencies().items():
        assert documented[package] == names, (
            f"docs/architecture.md says {package} depends on {sorted(documented[package])}; "
            f"{PYPROJECTS[package].relative_to(ROOT)} declares {sorted(names)}"
        )


def test_the_checks_see_a_wrong_table_and_a_wrong_import():
    """The parsers find something to compare (a table row is read; a disagreement would be caught)."""
    assert "ckpt" in allowed()["model"] and "model" not in allowed()["ckpt"]
    assert documented_dependencies()["parallel"] >= {"torch", "config"}
    assert _requirement_name("mistral-common[opencv]>=1.8") == "mistral-common"
