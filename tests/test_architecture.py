"""The package's shape, checked: its rooms (at most four modules loose at the top of ``acco_ds/``), layers that
import only downwards (``testing`` imported by no production module), no import circle, no module over 350 lines,
no class over 250, the runtime's parts in folders of their own (at most two modules loose in ``runtime/``), each
outer loop's rule in its own module (no EDiT or CO2 branch elsewhere), and tests that import the package and
their own helpers, never a benchmark."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "acco_ds"

ROOMS = {"config", "cli", "plan", "memory", "runtime", "deepspeed", "torch", "algorithms", "ops", "testing"}
LOOSE = {"__init__", "_autopatch", "_lazy_dynamo", "safe_load"}  # at most four, the package's face among them

# Bottom-up: a module imports its own room and the layers below, never a layer above nor another room of its own
# layer. The bottom: kernels, pure schedules and the start-up plumbing (torch._dynamo deferred, safe loads).
LAYERS = (
    {"ops", "algorithms", "_lazy_dynamo", "safe_load"},
    {"config"},  # the "acco" block and its rules: no host, no runtime
    {"runtime"},  # buffers, communication, updates, outer loops: no host
    {"deepspeed", "torch", "memory"},  # the hosts, and the estimator of what the runtime allocates
    {"plan", "__init__"},  # the planner, and the package's face (initialize, patch, estimate_memory)
    {"_autopatch"},  # the start-up hook (acco_ds_autopatch.pth): patches through the face
    {"cli"},  # the commands: acco-ds (report, memory, plan), acco-ds-run, acco-ds-warm
    {"testing"},  # the simulator (the tests' oracle) may read anything; no production module imports it
)


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(mods):
    """Every import between the package's modules, lazy ones (inside functions) included."""
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                base = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs or [base]  # `from . import ops` imports ops, not its parent again
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges[name] |= {t for t in targets if t in mods and t != name}
    return edges


def _cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _room(module: str) -> str:
    """``acco_ds.runtime.rounds.job`` -> ``runtime``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def _upward(edges) -> list:
    """Imports that go up a layer, or sideways into another room of the same layer."""
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if _room(a) != _room(b) and _layer(_room(b)) >= _layer(_room(a)))


def test_the_package_draws_its_rooms():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert len(loose) <= 4 and loose <= LOOSE, sorted(loose)
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == ROOMS, sorted(rooms ^ ROOMS)
    assert {room for layer in LAYERS for room in layer} == ROOMS | LOOSE


def test_layers_import_only_downwards():
    """Lazy imports inside functions count: a host-free layer stays host-free on every path."""
    edges = _imports(_modules())
    assert sorted({_room(m) for m in edges} - ROOMS - LOOSE) == []  # every module has its layer
    assert "acco_ds.config" in edges["acco_ds.runtime.outer.base"]  # the scan sees a lazy import
    assert _upward({"acco_ds.config.acco": {"acco_ds.deepspeed.compat"}, "acco_ds.deepspeed.engine":
                    {"acco_ds.torch", "acco_ds.config"}}) == [  # it would catch an upward and a sideways edge
        "acco_ds.config.acco -> acco_ds.deepspeed.compat", "acco_ds.deepspeed.engine -> acco_ds.torch"]
    assert _upward(edges) == []
    assert [f"{a} -> {b}" for a, targets in sorted(edges.items()) for b in sorted(targets)
            if _room(b) == "testing" and _room(a) != "testing"] == []


def _test_imports(path) -> set:
    """The top-level names a test file imports (lazy ones included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
    return names


def test_tests_import_no_benchmark():
    """Tests import the package and their own helpers; a benchmark's module (benchmarks/*.py) is no helper."""
    benchmarks = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {"benchmarks"}
    own = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    assert "harness" in benchmarks and "common" in own  # the scan sees both sides
    offenders = {str(path.relative_to(ROOT)): sorted(found) for path in sorted((ROOT / "tests").rglob("*.py"))
                 if (found := (_test_imports(path) - own) & benchmarks)}
    assert offenders == {}


def test_no_import_circle():
    edges = _imports(_modules())
    assert edges["acco_ds.runtime.outer.streaming"] >= {"acco_ds.runtime.outer.diloco"}  # the scan sees imports
    assert _cycles(edges) == []


def test_no_module_over_350_lines_and_no_class_over_250():
    long = []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 350:
            long.append(f"module {name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                long.append(f"class {name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_the_runtime_draws_its_rooms():
    runtime = PACKAGE / "runtime"
    loose = sorted(p.name for p in runtime.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 2, loose
    assert {p.name for p in runtime.iterdir() if p.is_dir() and (p / "__init__.py").exists()} >= \
        {"rounds", "comm", "outer"}


def _branches(tree) -> set:
    """Which modes a module's code asks about: a comparison with "co2"/"edit", the names CO2/EDIT, or the
    attributes a mode keeps (``.edit``, ``.in_flight``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for c in [node.left, *node.comparators]:
                if isinstance(c, ast.Constant) and c.value in ("co2", "edit"):
                    found.add(c.value)
        elif isinstance(node, ast.Name) and node.id in ("CO2", "EDIT"):
            found.add(node.id.lower())
        elif isinstance(node, ast.Attribute) and node.attr in ("edit", "in_flight"):
            found.add("edit" if node.attr == "edit" else "co2")
    return found


def test_each_outer_loop_holds_its_own_rule():
    """No module of the outer loops asks for EDiT or CO2 but their own; one class per loop."""
    outer = PACKAGE / "runtime" / "outer"
    trees = {path.stem: ast.parse(path.read_text()) for path in outer.glob("*.py")}
    assert _branches(ast.parse('if mode == "co2" or self.edit: pass')) == {"co2", "edit"}  # the scan sees them
    offenders = {name: found for name, tree in trees.items()
                 if (found := _branches(tree) - ({"edit"} if name.startswith("edit") else set())
                     - ({"co2"} if name == "co2" else set()))}
    assert offenders == {}
    classes = {name: [n.name for n in tree.body if isinstance(n, ast.ClassDef)] for name, tree in trees.items()}
    assert classes["diloco"] == ["DiLoCo"] and classes["co2"] == ["CO2"] and "EDiT" in classes["edit"]
    assert classes["streaming"] == ["StreamingDiLoCo"] and classes["base"] == ["LocalSGD"]
