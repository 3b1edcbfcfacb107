"""Every program a test or sandbox runs is installed by a fixture, the venv, or the base system.

CI runs on a fresh Debian 12 machine: a program installed by hand where the suite last passed
(iptables was) fails there. This reads the sources under tests/ (no test is run) and finds the
command lines handed to ``subprocess``/``os.exec*`` and to the tests' own wrappers of them
(``_sh``, ``_in``, ``box.popen``, ``nodes.start`` …, found by following parameters into those
calls), through ``ip netns exec``/``nsenter``/``unshare`` and ``sh -c`` scripts. Each program must
be in ``tests/sandbox/tools.py``: in ``BASE`` or ``VENV``, or in ``APT`` *and* passed to
``ensure()`` (or ``sandbox_fixture(needs=…)``) by its module or a tests module it imports.

Programs started inside containers (``engine.docker("run", …)``) are the image's, not this
machine's: the docker wrapper is one program, ``docker``. A command whose program is computed
(``sys.executable``, a path found by ``shutil.which``) must be named in ``COMPUTED`` below.
"""
from __future__ import annotations

import ast
import functools
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sandbox import tools

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
STDLIB_RUNNERS = {("subprocess", n): {0} for n in ("run", "Popen", "call", "check_call",
                                                    "check_output")}
STDLIB_RUNNERS |= {("os", n): {1} for n in ("execv", "execvp", "execvpe")}
# Computed program expressions (source text) -> the program they name.
COMPUTED = {
    "sys.executable": "python",
    "self.client": "docker",  # Engine.client: docker.io's CLI
    "exe": "shellcheck", "shellcheck": "shellcheck",  # found beside sys.executable
    "_tool('hadolint')": "hadolint", "_tool('shellcheck')": "shellcheck",
    "_kubectl()": "kubectl", "kubectl()": "kubectl",  # tests/k8s_check.py: PyPI's or PATH's
    "str(BIN / 'ddp-smoke-submit')": "ddp-smoke-submit", "str(BIN / 'torchrun')": "torchrun",
    "str(launch.BIN / 'torchrun')": "torchrun",
    "pod.argv": "sh", "master.argv": "sh",  # a manifest's command, with a stand-in torchrun
    "here(pod.argv, tmp_path, pod)": "sh",  # the same, with the checkout's pod script
    "plot.INSTALL.split()": "python",  # .venv/bin/python -m pip install matplotlib
    "host_argv": "sh",
    "PY": "python",  # tests/launchers/test_preflight.py: sys.executable
    "str(Path(sys.executable).parent / 'ddp-smoke-submit')": "ddp-smoke-submit",
    "argv[0]": None,  # execvp(argv[0], argv): argv is read as the command itself
}
# Wrappers that run other commands: their arguments after the prefix are a command again.
SHELLS = {"sh", "bash"}
SHELL_WORDS = {"exec", "cd", "export", "set", "test", "[", "echo", "printf", "true", "false",
               "read", "wait", "kill", "trap", ".", "source", "local", "return", "exit",
               "shift", "if", "then", "else", "elif", "fi", "for", "do", "done", "while",
               "until", "case", "esac", "in", "{", "}", "!", "command", "eval", "unset", ":"}
LEADS = {"exec", "command", "if", "then", "else", "elif", "do", "while", "until", "!", "{"}
PROGRAM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


@dataclass
class Use:
    program: str
    where: str  # file:line


@dataclass
class Module:
    path: Path
    tree: ast.Module
    name: str  # tests.x.y
    imports: set[str] = field(default_factory=set)
    constants: dict[str, ast.expr] = field(default_factory=dict)
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)  # nested too
    aliases: dict[str, tuple[str, str]] = field(default_factory=dict)  # from tests.x import f as g


def _load() -> dict[str, Module]:
    modules = {}
    for path in sorted(TESTS.rglob("*.py")):
        mod = _module(path, path.read_text())
        modules[mod.name] = mod
    return modules


def _module(path: Path, source: str) -> Module:
    rel = path.relative_to(REPO).with_suffix("")
    mod = Module(path, ast.parse(source, str(path)), ".".join(rel.parts))
    for node in mod.tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            mod.constants[node.targets[0].id] = node.value
    in_class = {id(f) for c in ast.walk(mod.tree) if isinstance(c, ast.ClassDef)
                for f in c.body if isinstance(f, ast.FunctionDef)}
    mod.functions = {f.name: f for f in ast.walk(mod.tree)
                     if isinstance(f, ast.FunctionDef) and id(f) not in in_class}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
            mod.imports.add(node.module)
            mod.imports.update(f"{node.module}.{a.name}" for a in node.names)
            mod.aliases.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        elif isinstance(node, ast.Import):
            mod.imports.update(a.name for a in node.names if a.name.startswith("tests"))
    return mod


def _params(fn: ast.FunctionDef) -> list[str]:
    """Positional parameters as a caller counts them (self aside), then the vararg."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    names = names[1:] if names[:1] in (["self"], ["cls"]) else names
    return names + ([fn.args.vararg.arg] if fn.args.vararg else [])


def _own_nodes(fn: ast.AST):
    """The nodes of fn's own code: nested functions and classes are scanned on their own."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


class _Body:
    """One function's own code (or a module's top level): nodes, parameters, local values."""

    def __init__(self, mod: "Module", fn, parent: "_Body | None" = None):
        self.mod = mod
        if parent is not None:  # the same code, read with no parameters (a harvested list)
            self.nodes, self.local, self.params = parent.nodes, parent.local, []
            return
        self.nodes = list(_own_nodes(fn))
        self.params = _params(fn) if isinstance(fn, ast.FunctionDef) else []
        self.local = {}
        for node in self.nodes:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                self.local.setdefault(node.targets[0].id, node.value)


class Scanner:
    """Finds the programs each module runs; wrappers are learnt until nothing new is found."""

    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        # wrapper key -> indices of the arguments that are commands (a vararg: where it starts)
        self.wrappers: dict[tuple, set[int]] = {k: set(v) for k, v in STDLIB_RUNNERS.items()}
        self.uses: dict[str, list[Use]] = {}
        self.unreadable: list[str] = []

    def run(self) -> None:
        while True:
            before = {k: set(v) for k, v in self.wrappers.items()}
            self.uses = {name: [] for name in self.modules}
            self.unreadable = []
            for mod in self.modules.values():
                for fn in ast.walk(mod.tree):
                    if isinstance(fn, (ast.FunctionDef, ast.Module)):
                        self._scan_body(mod, fn)
            if self.wrappers == before:
                return

    # -- which calls run a command ----------------------------------------------------------

    def _callee(self, mod: Module, call: ast.Call) -> tuple | None:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                (f.value.id, f.attr) in STDLIB_RUNNERS:
            return (f.value.id, f.attr)
        if isinstance(f, ast.Attribute):
            return ("method", f.attr)
        if isinstance(f, ast.Name):
            if f.id in mod.functions:
                return (mod.name, f.id)
            owner, name = mod.aliases.get(f.id, (None, None))  # from tests.x import f as g
            while owner in self.modules and name not in self.modules[owner].functions:
                owner, name = self.modules[owner].aliases.get(name, (None, None))  # re-exported
            if owner in self.modules:
                return (owner, name)
        return None

    def _scan_body(self, mod: Module, fn) -> None:
        """Scans the calls of fn's own code (a nested function is scanned on its own)."""
        ctx = _Body(mod, fn)
        for call in ctx.nodes:
            if not isinstance(call, ast.Call):
                continue
            key = self._callee(mod, call)
            if key not in self.wrappers:
                continue
            for at in sorted(self.wrappers[key]):
                words = self._command(call, at)
                if words is None:
                    continue
                where = f"{mod.path.relative_to(REPO)}:{call.lineno}"
                index = self._program(ctx, words, where)
                if index is not None and isinstance(fn, ast.FunctionDef):
                    wrapper = (mod.name, fn.name) if mod.functions.get(fn.name) is fn else \
                        ("method", fn.name)
                    self.wrappers.setdefault(wrapper, set()).add(index)

    @staticmethod
    def _command(call: ast.Call, index: int) -> list[ast.expr] | None:
        """The command's words at the call: a list argument, or the arguments from index on."""
        if index >= len(call.args):
            return None
        arg = call.args[index]
        if isinstance(arg, (ast.List, ast.Tuple)):
            return list(arg.elts)
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) or \
                isinstance(arg, ast.Starred):
            return list(call.args[index:])  # a vararg wrapper: _sh("tc", "qdisc", …)
        return [arg]

    # -- what a command runs ------------------------------------------------------------------

    def _resolve(self, ctx: "_Body", e: ast.expr, depth: int = 0) -> ast.expr:
        """e reduced to a list literal where the code says which (else e itself)."""
        if depth > 8:
            return e
        again = None
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and \
                e.func.id in ("list", "tuple", "sorted") and e.args:
            again = e.args[0]
        elif isinstance(e, (ast.ListComp, ast.GeneratorExp)):
            again = e.generators[0].iter  # [str(a) for a in argv]
        elif isinstance(e, ast.Call):
            inlined = self._inline(ctx.mod, e)  # host_command(host, argv): the list it returns
            again = inlined if inlined is not e else None
        elif isinstance(e, ast.Name) and e.id not in ctx.params:
            again = ctx.local.get(e.id, ctx.mod.constants.get(e.id))
        elif isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            left, right = self._resolve(ctx, e.left, depth + 1), e.right
            if isinstance(left, (ast.List, ast.Tuple)):
                return ast.List(elts=[*left.elts, ast.Starred(value=right)], ctx=ast.Load())
        elif isinstance(e, ast.IfExp):  # [*prefix, "tc"]: the branch that has a program
            body = self._resolve(ctx, e.body, depth + 1)
            again = e.body if isinstance(body, ast.List) and body.elts else e.orelse
        return e if again is None else self._resolve(ctx, again, depth + 1)

    def _expand(self, ctx: "_Body", words: list[ast.expr]) -> list[ast.expr]:
        """Splices `*name` (and a lone name) into the literal list it stands for, where known."""
        out = []
        for w in words:
            inner = w.value if isinstance(w, ast.Starred) else w if len(words) == 1 else None
            value = self._resolve(ctx, inner) if inner is not None else w
            if isinstance(value, (ast.List, ast.Tuple)):
                out += self._expand(ctx, list(value.elts))
            else:
                out.append(ast.Starred(value=value) if isinstance(w, ast.Starred) else value)
        return out

    def _inline(self, mod: Module, call: ast.Call) -> ast.expr:
        """The list a tests function returns, its parameters replaced by the call's arguments."""
        key = self._callee(mod, call)
        if not key or key[0] not in self.modules:
            return call
        fn = self.modules[key[0]].functions[key[1]]
        returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
        if len(returns) != 1 or not isinstance(returns[0], ast.List):
            return call
        bound = dict(zip(_params(fn), call.args))

        def sub(e: ast.expr) -> ast.expr:
            if isinstance(e, ast.Starred):
                return ast.Starred(value=sub(e.value), ctx=ast.Load())
            return bound.get(e.id, e) if isinstance(e, ast.Name) else e

        return ast.List(elts=[sub(e) for e in returns[0].elts], ctx=ast.Load())

    def _program(self, ctx: "_Body", words: list[ast.expr], where: str) -> int | None:
        """Records the programs of a command; returns the parameter index if it is passed in."""
        words = self._expand(ctx, words)
        while words:
            head = words[0]
            inner = head.value if isinstance(head, ast.Starred) else head
            text = ast.unparse(inner)
            if text in COMPUTED:
                if COMPUTED[text]:
                    self.uses[ctx.mod.name].append(Use(COMPUTED[text], where))
                return None
            if isinstance(inner, ast.Name) and inner.id in ctx.params:
                return ctx.params.index(inner.id)  # the caller names the program
            if not (isinstance(inner, ast.Constant) and isinstance(inner.value, str)):
                if not self._harvest(ctx, where):
                    self.unreadable.append(f"{where}: `{text}`")
                return None
            prog = inner.value.rsplit("/", 1)[-1]
            self.uses[ctx.mod.name].append(Use(prog, where))
            words = self._next_command(prog, words[1:], ctx.mod, where)
        return None

    def _harvest(self, ctx: "_Body", where: str) -> bool:
        """A command built in a loop (`for what, argv in steps`): the command lists of its
        function stand for it. Returns whether there were any."""
        found = False
        for lst in ctx.nodes:
            if isinstance(lst, ast.List) and lst.elts:
                head = lst.elts[0]
                literal = isinstance(head, ast.Constant) and isinstance(head.value, str) and \
                    PROGRAM.match(head.value) is not None
                if literal or ast.unparse(head) in COMPUTED:
                    found = True
                    self._program(_Body(ctx.mod, None, ctx), list(lst.elts), where)
        return found

    def _next_command(self, prog: str, rest: list[ast.expr], mod: Module,
                      where: str) -> list[ast.expr]:
        """The command a wrapper program runs from its arguments (empty when none)."""
        lit = [w.value if isinstance(w, ast.Constant) else None for w in rest]
        if prog == "ip" and lit[:2] == ["netns", "exec"]:
            return rest[3:]
        if prog in ("nsenter", "unshare", "setsid"):
            i = 0
            while i < len(rest) and (isinstance(rest[i], ast.JoinedStr) or
                                     str(lit[i]).startswith("-")):
                i += 1
            return rest[i:]
        if prog in SHELLS and "-c" in lit and lit.index("-c") + 1 < len(rest):
            at = lit.index("-c") + 1
            script = lit[at]
            if isinstance(script, str):
                for word in _script_programs(script):
                    self.uses[mod.name].append(Use(word, where))
                if '"$@"' in script:
                    return rest[at + 2:]  # $0, then the command
        return []

    # -- what a module installs ----------------------------------------------------------------

    def ensured(self, name: str, seen: set | None = None) -> set[str]:
        """Programs passed to ensure()/needs= by a module or by tests modules it imports."""
        seen = set() if seen is None else seen
        if name in seen or name not in self.modules:
            return set()
        seen.add(name)
        mod, out = self.modules[name], set()
        for call in ast.walk(mod.tree):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if fname == "ensure":
                out |= self._strings(mod, call.args)
            elif fname == "sandbox_fixture":
                out |= self._strings(mod, [k.value for k in call.keywords if k.arg == "needs"])
        for other in mod.imports:
            out |= self.ensured(other, seen)
        return out

    def _strings(self, mod: Module, exprs: list[ast.expr]) -> set[str]:
        out = set()
        for e in exprs:
            e = e.value if isinstance(e, ast.Starred) else e
            if isinstance(e, ast.Name):
                e = mod.constants.get(e.id, e)
            if isinstance(e, ast.Dict):
                e = ast.List(elts=e.keys)
            if isinstance(e, (ast.List, ast.Tuple, ast.Set)):
                out |= self._strings(mod, list(e.elts))
            elif isinstance(e, ast.Constant) and isinstance(e.value, str):
                out.add(e.value)
        return out


def _script_programs(script: str) -> list[str]:
    """The commands of a shell script: each first word of a simple command, builtins aside."""
    progs = []
    for line in script.splitlines():
        lex = shlex.shlex(line.split(" #", 1)[0], posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        first = True
        for tok in lex:
            if tok and set(tok) <= set(";&|()"):
                first = True  # an operator: a command follows
            elif not first or "=" in tok.split("/")[0]:
                continue  # an argument, or VAR=value before the command
            elif tok in SHELL_WORDS:
                first = tok in LEADS
            else:
                first = False
                name = tok.rsplit("/", 1)[-1]
                if "$" not in tok and PROGRAM.match(name):
                    progs.append(name)
    return progs


@functools.cache
def scan() -> Scanner:
    scanner = Scanner(_load())
    scanner.run()
    return scanner


def uncovered(scanner: Scanner) -> list[str]:
    """Each program that nothing installs, with where it runs: `program (why): file:line …`."""
    problems: dict[str, list[str]] = {}
    for name, uses in scanner.uses.items():
        ensured = scanner.ensured(name)
        for use in uses:
            if use.program in tools.BASE or use.program in tools.VENV:
                continue
            if use.program not in tools.APT:
                why = "in no table of tests/sandbox/tools.py (APT, VENV, BASE)"
            elif use.program not in ensured:
                why = (f"apt {tools.APT[use.program]}, never passed to tools.ensure() by "
                       f"{name} or a tests module it imports")
            else:
                continue
            problems.setdefault(f"{use.program} ({why})", []).append(use.where)
    return [f"{what}: {', '.join(sorted(set(where)))}" for what, where in sorted(problems.items())]


def test_every_program_a_test_runs_is_installed_by_a_fixture():
    scanner = scan()
    assert not scanner.unreadable, (
        "cannot tell which program these commands run; name it in COMPUTED:\n  "
        + "\n  ".join(scanner.unreadable))
    problems = uncovered(scanner)
    assert not problems, "\n".join(problems)


def test_the_scan_sees_the_programs_it_must():
    """A scan that finds nothing passes vacuously: it must see these through their wrappers."""
    found = {(name, u.program) for name, uses in scan().uses.items() for u in uses}
    assert {("tests.worker.test_diagnosis_network", "iptables"),  # _in(host, "iptables", …)
            ("tests.worker.test_diagnosis_network", "tc"),  # _sh("tc", …)
            ("tests.outputs.test_hosts_real", "tc"),
            ("tests.sandbox.hosts", "ip"), ("tests.sandbox.hosts", "nsenter"),
            ("tests.sandbox.hosts", "hostname"),  # inside host_command's `sh -c`
            ("tests.worker.test_multihost", "python"),  # nodes.start(host, torchrun_argv(…))
            ("tests.launchers.test_slurm", "sbatch"), ("tests.launchers.test_slurm", "scontrol"),
            ("tests.sandbox.docker", "dockerd"), ("tests.sandbox.docker", "debootstrap"),
            ("tests.sandbox.docker", "docker")} <= found


def test_the_venv_programs_come_from_the_projects_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower()
                for d in project["dependencies"] + project["optional-dependencies"]["test"]}
    declared |= {project["name"], "python"}
    assert {dist for dist in tools.VENV.values()} <= declared


FIXTURELESS = """
import subprocess
from tests.sandbox import tools

def _in(netns, *argv):
    subprocess.run(["ip", "netns", "exec", netns, *argv], check=True)

def test_cut():
    tools.ensure("ip", "tc")
    _in("ns1", "tc", "qdisc", "show")
    _in("ns1", "iptables", "-I", "INPUT", "-j", "DROP")
    subprocess.run(["frobnicate", "--all"])
"""


def test_a_program_no_fixture_installs_is_named_with_where_it_runs():
    """What caught iptables in tests/worker/test_diagnosis_network.py, on a module of its shape."""
    scanner = Scanner({**_load(), "tests.test_fake": _module(TESTS / "test_fake.py", FIXTURELESS)})
    scanner.run()
    problems = [p for p in uncovered(scanner) if "test_fake.py" in p]
    assert problems == [
        "frobnicate (in no table of tests/sandbox/tools.py (APT, VENV, BASE)): "
        "tests/test_fake.py:12",
        "iptables (apt iptables, never passed to tools.ensure() by tests.test_fake or a tests "
        "module it imports): tests/test_fake.py:11"], problems


def test_the_script_reader_finds_commands_not_words():
    assert _script_programs('hostname "$0" && exec "$@"') == ["hostname"]
    assert _script_programs("set -e; X=1 iptables -L | grep -q x || exit 1") == \
        ["iptables", "grep"]
    assert _script_programs('exec "$PY" -m x') == []


def test_ensure_refuses_a_program_it_does_not_know_and_passes_one_that_is_there():
    tools.ensure("sh", "tar")  # present: nothing to install, no apt run
    with pytest.raises(tools.MissingProgram, match="not in tests/sandbox/tools.py APT"):
        tools.ensure("ddp-smoke-no-such-program")
