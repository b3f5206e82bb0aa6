"""The package's shape, checked: no import circle, no module over 350 lines, no class over 250, the runtime's
parts in folders of their own (at most two modules loose in ``runtime/``), and each outer loop's rule in its
own module (no EDiT or CO2 branch elsewhere)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "acco_ds"


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
