"""The package's folders are its architecture: layers import downwards only, no cycles.

Read from the source (every import statement, at module level or inside a function), not by
importing: a late import inside a function that closes a cycle counts as much as a top one.
"""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "job" / "ddp_smoke"
# Lowest first. A module may import its own layer and those below it.
LAYERS = [("errors", "redact", "interfaces"), ("model",), ("config",), ("coordination",), ("checks",),
          ("outputs",), ("harness",),
          ("cli", "submit", "submit_plan", "task", "preflight", "node_check", "launch_local",
           "store_host", "__main__")]
# The only import of the package's own modules allowed inside a function: the harness, which
# keeps torch out of `--help` and bad input (answered in a fraction of a second) and out of
# the submitting side of submitit. (Optional libraries, e.g. matplotlib, NVML, stay late.)
LATE_OK = ("ddp_smoke.harness",)
MAX_LINES, MAX_HARNESS_LINES = 450, 250


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of a ddp_smoke module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    late = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            found.append((t, node.lineno, id(node) in late))
    return found


def _graph():
    modules = _modules()
    edges, late = {}, []
    for name, path in modules.items():
        deps = set()
        for target, line, inside in _imports(name, path, modules):
            if inside:
                late.append((name, target, line))
            if not target.startswith("ddp_smoke"):
                continue
            # importing a.b.c runs a/__init__ and a/b/__init__ first, unless already running
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        edges[name] = deps
    return modules, edges, late


def _layer(module: str) -> int:
    first = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if first in names)


def _cycles(edges) -> list[list[str]]:
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_counting_imports_inside_functions():
    assert _cycles(_graph()[1]) == []


def test_layers_import_downwards_only():
    _, edges, _ = _graph()
    upward = [(a, b) for a, deps in edges.items() if a != "ddp_smoke" for b in deps
              if b != "ddp_smoke" and _layer(b) > _layer(a)]
    assert upward == []


def test_no_late_import_but_those_that_keep_torch_out_of_help():
    _, _, late = _graph()
    assert [x for x in late if x[1].startswith("ddp_smoke") and x[1] not in LATE_OK] == []


def test_module_sizes():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert sizes["ddp_smoke.harness"] <= MAX_HARNESS_LINES
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_help_and_bad_input_import_no_torch():
    probe = ("import sys\nfrom ddp_smoke import cli\n"
             "try:\n    cli.parse_config(['--checks', 'nope'])\nexcept Exception:\n    pass\n"
             "try:\n    cli.parse_config(['--help'], cli._parser())\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.stderr.strip().splitlines()[-1] == "False", done.stderr


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The rules above can fail: a late import closing a cycle, an upward import."""
    pkg = tmp_path / "ddp_smoke"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from .config import x\n")
    (pkg / "config" / "__init__.py").write_text("from ..errors import f\nx = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    _, edges, late = _graph()
    assert "ddp_smoke.config" in edges["ddp_smoke.errors"]
    assert late == [("ddp_smoke.errors", "ddp_smoke.config", 2)]
    assert _cycles(edges) == [["ddp_smoke.config", "ddp_smoke.errors", "ddp_smoke.config"]]
    assert _layer("ddp_smoke.config") > _layer("ddp_smoke.errors")
