"""The code's layout: the formats' modules import one another one way (a DAG), function-level imports included."""
import ast
from pathlib import Path

FORMATS = Path(__file__).resolve().parents[1] / "Models" / "formats"
PACKAGE = "Models.formats"


def imported_modules(path: Path, modules: set) -> set:
    """The modules of `modules` (the package's, by name; "__init__" the package) that `path` imports anywhere."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.removeprefix(PACKAGE + ".") for alias in node.names if alias.name.startswith(PACKAGE)}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif (node.level == 1 and not node.module) or node.module == PACKAGE:
                found |= {alias.name if alias.name in modules else "__init__" for alias in node.names}
            elif node.level == 0 and node.module and node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
    return found & modules


def import_cycle(graph: dict) -> list:
    """One cycle of `graph` (module -> modules it imports) as the path around it, or [] when it is a DAG."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in sorted(graph[module]):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return []

    return next((cycle for cycle in map(visit, sorted(graph)) if cycle), [])


def test_formats_import_one_way():
    modules = {path.stem for path in FORMATS.glob("*.py")}
    graph = {path.stem: imported_modules(path, modules) - {path.stem} for path in FORMATS.glob("*.py")}
    assert graph["base_model"] >= {"hf", "meta", "adapters"}  # the parse sees the imports
    assert not import_cycle(graph), " -> ".join(import_cycle(graph))
