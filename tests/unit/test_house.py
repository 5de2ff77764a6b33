"""The house: rooms import only rooms below them (the order of the README's map), no import cycle, a launch file
loads without torch, and nothing in the package can unpickle."""

from __future__ import annotations

import ast
import subprocess
import sys

from helpers.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "vla_node"
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}


def module_name(path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path) -> set[str]:
    """Every vla_node module `path` imports, at module level or inside a function (absolute names)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vla_node")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("vla_node"):
                for a in node.names:  # `from vla_node.bench import cache` imports the module vla_node.bench.cache
                    sub = f"{base}.{a.name}"
                    found.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else base)
    return found


def modules() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def rooms_from_readme() -> list[list[str]]:
    """The README map's rooms, top first: each row's first column (`cli.py`, `node/`, ...); a row may hold several
    rooms of one level separated by commas."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## The house", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[name.strip("`/ ").removesuffix(".py") for name in row.split("|")[1].split(",")] for row in rows]


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_belongs_to_a_room_of_the_readme_map():
    rooms = {room for level in rooms_from_readme() for room in level}
    missing = {room_of(m) for m in modules()} - rooms - {"__init__"}
    assert not missing, f"modules in rooms the README map does not list: {sorted(missing)}"


def test_rooms_import_only_rooms_below_them():
    level = {room: i for i, names in enumerate(rooms_from_readme()) for room in names}
    upward = [f"{m} -> {dep}" for m, deps in modules().items() for dep in deps
              if room_of(dep) != room_of(m) and room_of(m) in level and level[room_of(dep)] <= level[room_of(m)]]
    assert not upward, "imports of a room at the same level or above:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = modules()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if dep == module:
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [module, dep] if dep in path else [module, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])


def test_a_launch_file_loads_without_importing_torch():
    code = ("import sys; from vla_node.config import default_launch, load_launch; load_launch(default_launch()); "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def unsafe_uses(source: str) -> list[str]:
    """Unpickling anywhere: an unsafe module imported, ZeroMQ's recv_pyobj, numpy's allow_pickle=True, or torch.load
    without weights_only=True."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj"):
            found.append(node.attr)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            if name.endswith("torch.load") and keywords.get("weights_only") != "True":
                found.append(f"{name} without weights_only=True")
            if keywords.get("allow_pickle") == "True":
                found.append(f"{name}(allow_pickle=True)")
    return found


def test_nothing_in_the_package_can_unpickle():
    found = {module_name(p): uses for p in sorted(PACKAGE.rglob("*.py")) if (uses := unsafe_uses(p.read_text()))}
    assert not found, found


def test_the_unpickle_check_catches_each_form():
    for source in ("import pickle", "from marshal import loads", "import shelve", "import dill",
                   "sock.recv_pyobj()", "torch.load(f)", "torch.load(f, weights_only=False)",
                   "np.load(f, allow_pickle=True)"):
        assert unsafe_uses(source), source
    assert not unsafe_uses("torch.load(f, weights_only=True)\nnp.load(f)\nimport msgpack")


def test_the_readme_map_names_every_room_once():
    names = [room for level in rooms_from_readme() for room in level]
    assert len(names) == len(set(names)) and names[0] == "cli", names
