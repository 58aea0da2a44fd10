"""The package's layout (docs/development.md): rooms in layers, no import upward or in a circle, no file over ~400
lines, one-line docstrings. Every import counts, also one inside a function: a lazy import is still a dependency.
No module reads another object's private names (`x._name` with x not self or cls). And every citation in the code and docs can be followed from a clone: no document outside the repository, no
file path, page anchor or docs/architecture.md section that does not exist."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dataplane_rl"
MAX_LINES = 420  # "about 400": a file past this is two files

# Rooms from the bottom up; a room may import only rooms on its own layer or below (docs/development.md).
LAYERS = [
    {"errors", "config_types", "yaml_load", "resources", "hosts", "units", "rng", "trace", "ray_calls", "pids",
     "__init__"},  # foundation
    {"schema"},
    {"config"},
    {"algorithms"},
    {"store"},
    {"tasks", "model", "columns"},
    {"rollout"},
    {"checkpoint"},
    {"train"},
    {"run"},
    {"faults"},
    {"driver"},
    {"bench", "cli"},
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def room_of(module: str) -> str:
    """dataplane_rl.store.shm -> store; dataplane_rl.errors -> errors."""
    return module.split(".")[1] if module.count(".") else "__init__"


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(path: Path, name: str) -> set[str]:
    """Every dataplane_rl module this file imports, resolved to a module that exists."""
    mods = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            # `from pkg import submodule` depends on the submodule (a package's own __init__ runs first anyway)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        for t in targets:
            if t.startswith("dataplane_rl"):
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    return {name: imports_of(path, name) for name, path in modules().items()}


def test_every_room_has_a_layer():
    rooms = {room_of(m) for m in modules()}
    assert rooms <= set(RANK), f"rooms without a layer in this test and docs/development.md: {sorted(rooms - set(RANK))}"


def test_no_upward_import():
    upward = [f"{m} ({room_of(m)}) imports {t} ({room_of(t)})" for m, ts in graph().items() for t in sorted(ts)
              if RANK[room_of(t)] > RANK[room_of(m)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_circle_between_rooms():
    edges = {}
    for m, ts in graph().items():
        for t in ts:
            if room_of(t) != room_of(m):
                edges.setdefault(room_of(m), set()).add(room_of(t))
    cycle = find_cycle(edges)
    assert cycle is None, "rooms import each other in a circle: " + " -> ".join(cycle)


def test_no_circle_between_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(n: str, stack: list[str]):
        state[n] = 1
        stack.append(n)
        for t in sorted(edges.get(n, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t, stack)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n, [])):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_is_small_and_says_what_it_is(name):
    path = modules()[name]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PKG.parent)} has {lines} lines; split it by idea (docs/development.md)"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{path.relative_to(PKG.parent)} has no module docstring"


# ---- private names: an object's `_name` is read by that object (self, cls, super()) only --------------------
# Names that look private but are a library's public interface, anywhere.
PUBLIC_UNDERSCORE = {
    "_replace", "_asdict", "_fields", "_make",  # collections.namedtuple's documented methods
    "_exit",  # os._exit: the documented exit without cleanup (a forked child, a supervisor)
}
# Reads of a library's internals that have no public equivalent: (module, expression) -> why.
PRIVATE_READS = {
    ("dataplane_rl.faults.train_ranks", "w._actor_id"):
        "Ray's ActorHandle has no public id; RayActorError names the dead actor only by that id's hex",
    ("dataplane_rl.faults.train_ranks", "getattr(ray, '_private')"):
        "Ray has no public way to its node's log folder, where a dead rank's last output is",
    ("dataplane_rl.faults.train_ranks", "getattr(getattr(ray, '_private').worker, '_global_node', None)"):
        "the same: the node object that knows the log folder",
    ("dataplane_rl.run.private_ray", "worker._global_node"): "Ray's node object: the processes it started",
    ("dataplane_rl.hosts", "lib._ZN8mooncake12globalConfigEv"): "a C++ symbol of Mooncake's library, found by ctypes",
    ("dataplane_rl.train.fsdp", "getattr(model, '_no_split_modules', None)"):
        "Hugging Face's models name their blocks to shard only there (what accelerate's FSDP wrapping reads too)",
}


def private_reads(text: str, where: str, name: str) -> list[str]:
    """Every `x._name` (and getattr(x, "_name")) in module `name` (source `text`) where x is not self, cls or
    super(), not a module of the same room imported by name, and not allowed above."""
    tree = ast.parse(text)
    mods, room = modules(), room_of(name)
    own = set()  # names bound to a dataplane_rl module of the same room: its private helpers are the room's own
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            own |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name in mods and room_of(a.name) == room
                    and (a.asname or "." not in a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dataplane_rl"):
            own |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in mods
                    and room_of(f"{node.module}.{a.name}") == room}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr, owner = node.attr, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, owner = node.args[1].value, node.args[0]
        else:
            continue
        if not attr.startswith("_") or attr.startswith("__") and attr.endswith("__") or attr in PUBLIC_UNDERSCORE:
            continue
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in own):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        if (name, ast.unparse(node)) not in PRIVATE_READS:
            bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_no_module_reads_another_objects_private_names():
    """An object's private names are its own: another object asks through a public method or attribute (the Fleet's
    interface, the store protocol's capabilities), or the exception is listed in PRIVATE_READS with its reason."""
    bad = [b for name, path in modules().items()
           for b in private_reads(path.read_text(), str(path.relative_to(PKG.parent)), name)]
    assert not bad, ("reads of another object's private names; add a public method or attribute to the owner "
                     "instead:\n" + "\n".join(bad))


def test_private_read_check_finds_what_it_should():
    """The checker itself: reads through another object are found; self, super(), a library's public underscore
    names and a same-room module's private helper pass."""
    text = ("import os\nfrom dataplane_rl.driver import rollouts\n"
            "def f(self, fleet, store):\n"
            "    self._a, super()._b(), os._exit, rollouts._helper, fleet.rollout._c, self.p._replace()\n"
            "    return store._gauges(), getattr(fleet, '_refits'), fleet._groups[0], getattr(self, '_x')\n")
    found = sorted(b.split(": ", 1)[1] for b in private_reads(text, "driver/example.py", "dataplane_rl.driver.example"))
    assert found == ["fleet._groups", "fleet.rollout._c", "getattr(fleet, '_refits')", "store._gauges"], found


# ---- citations: the code and docs cite only what a clone of the repository holds ----------------------------
ROOT = PKG.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# where contributors read: text files of these folders, and the top-level pages
READ = ["dataplane_rl", "tests", "docs", "scripts", "benchmarks", "examples", "configs", "schema", ".ci"]
TEXT = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".c", ""}
# a path cited from a folder of the repository (or a room of the package: `store/base.py`) must exist; other
# paths in the text (RUN_DIR/trace.json, runs/latest/..., a library's own files) are not citations of ours
CITABLE = set(READ) | {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
# a document outside the repository: the old design's section numbers, the workspace's shared folders
OUTSIDE = re.compile(r"DESIGN\s*§|(?<![\w.])\.\./shared\b|\bshared[/]research\b|(?<![\w.])/work[/]\w")
# a relative file path: never part of a URL or of a longer path (what precedes it is no word, '/', '.', ':')
PATH = re.compile(r"(?<![\w./:@~$-])((?:\.\./)*(?:[\w.-]+/)+[\w.-]*\w\.(?:md|py|yaml|yml|sh|toml|json|c|parquet|png))"
                  r"(?![\w/])(?:#([\w-]+))?")
SECTION_CITED = re.compile(r"architecture\.md\)?,? §\s?(\d+(?:\.\d+)*)")
SECTION_HEADING = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)


def read_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in READ:
        files += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and p.suffix in TEXT
                  and "__pycache__" not in p.parts and not p.name.startswith(".")]
    return [p for p in files if p.exists()]


def cited_text(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a file says to its reader. A test's string literals are its data (a page it writes to
    a temporary folder may link a file that does not exist, on purpose), so of a test only the comments and
    docstrings count; of any other file, all of it."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py" or "tests" not in path.relative_to(ROOT).parts[:1]:
        return list(enumerate(text.splitlines(), 1))
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return out


def architecture_sections() -> set[str]:
    return set(SECTION_HEADING.findall(ARCHITECTURE.read_text())) if ARCHITECTURE.exists() else set()


def bad_citations(path: Path, lines: list[tuple[int, str]], sections: set[str]) -> list[str]:
    """Every citation in `lines` of `path` that a clone of the repository cannot follow."""
    from test_readme import anchors

    where, bad = path.relative_to(ROOT), []
    for n, line in lines:
        bad += [f"{where}:{n}: cites a document outside the repository ({m[0]!r}); cite docs/architecture.md or a "
                "page of docs/ instead" for m in OUTSIDE.finditer(line)]
        for m in PATH.finditer(line):
            cited, anchor = m[1], m[2]
            first = cited.split("/")[0]
            if first != ".." and first not in CITABLE and not cited.endswith(".md"):
                continue  # not a path of ours (RUN_DIR/trace.json); a page (.md) of any folder must exist, though
            found = next((p for p in (ROOT / cited, path.parent / cited, PKG / cited)
                          if p.exists() and p.resolve().is_relative_to(ROOT.resolve())), None)  # ../ may leave it
            if found is None:
                bad.append(f"{where}:{n}: cites {cited}, which is not in the repository")
            elif anchor and found.suffix == ".md" and anchor not in anchors(found.read_text()):
                bad.append(f"{where}:{n}: cites {cited}#{anchor}, but {cited} has no such heading")
        bad += [f"{where}:{n}: cites docs/architecture.md §{s}, which has no section {s}"
                for s in SECTION_CITED.findall(line) if s not in sections]
    return bad


def test_citations_stay_inside_the_repository():
    """No reference to a document a clone lacks: the old design's section numbers or the workspace's shared
    folders; every cited file path (docs/X.md, dataplane_rl/..., tests/..., store/base.py) and page anchor exists;
    every docs/architecture.md section cited is a numbered heading there."""
    sections = architecture_sections()
    bad = [b for p in read_files() if p.resolve() != Path(__file__).resolve()
           for b in bad_citations(p, cited_text(p), sections)]
    assert not bad, "citations a clone of the repository cannot follow:\n" + "\n".join(bad)


def test_citation_check_finds_what_it_should():
    """The checker itself: each kind of bad citation is found; URLs, run outputs and existing files pass."""
    here = ROOT / "dataplane_rl" / "driver" / "x.py"
    lines = list(enumerate([
        "see DESIGN §4 and ../shared/STYLE.md and notes/shared" + "/research/x.md",  # outside: two hits
        "docs/nowhere.md, research/mission.md, store/nowhere.py, ../nowhere.py",  # four missing files
        "docs/store.md#no-such-heading, docs/architecture.md §99",  # a missing anchor, a missing section
        "docs/store.md, docs/store.md#ownership-and-store-gc, store/base.py, ../store/base.py, loop.py",  # fine
        "https://github.com/org/repo/blob/main/docs/nowhere.md, RUN_DIR/trace.json, runs/latest/summary.json",  # fine
    ], 1))
    bad = bad_citations(here, lines, {"4", "5.3"})
    assert [b.split(": ", 1)[1] for b in bad] == [
        "cites a document outside the repository ('DESIGN §'); cite docs/architecture.md or a page of docs/ instead",
        "cites a document outside the repository ('../shared'); cite docs/architecture.md or a page of docs/ instead",
        "cites a document outside the repository ('shared/research'); cite docs/architecture.md or a page of docs/ "
        "instead",
        "cites ../shared/STYLE.md, which is not in the repository",  # even where a folder beside the clone has it
        "cites notes/shared/research/x.md, which is not in the repository",
        "cites docs/nowhere.md, which is not in the repository",
        "cites research/mission.md, which is not in the repository",
        "cites store/nowhere.py, which is not in the repository",
        "cites ../nowhere.py, which is not in the repository",
        "cites docs/store.md#no-such-heading, but docs/store.md has no such heading",
        "cites docs/architecture.md §99, which has no section 99",
    ], "\n".join(bad)
    assert [b.split(":")[1] for b in bad] == ["1"] * 5 + ["2"] * 4 + ["3"] * 2


# ---- the Fleet: the run's processes, behind methods; the recoveries see it through their ports ---------------
FLEET = PKG / "driver" / "fleet.py"
PORTS = PKG / "faults" / "ports.py"
MAX_FLEET_ATTRIBUTES = 12


def assigned(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment statement writes, tuples unpacked; `x.a[i] = v` writes x.a too."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    out = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets += t.elts
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            out.append(t.value if isinstance(t, ast.Subscript) else t)
    return out


def class_attributes(path: Path, name: str) -> set[str]:
    """Class `name`'s data attributes: its class-level names, its properties and every `self.x = ...` in it."""
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    names = set()
    for node in cls.body:
        names |= {t.id for t in assigned(node) if isinstance(t, ast.Name)}
        if isinstance(node, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "property"
                                                     for d in node.decorator_list):
            names.add(node.name)
    for node in ast.walk(cls):
        names |= {t.attr for t in assigned(node)
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def writes_to_others(text: str, attrs: set[str]) -> list[str]:
    """Assignments in `text` to attribute `attrs` of an object other than self (an item of one included)."""
    return [f"{t.lineno}: {ast.unparse(t)}" for node in ast.walk(ast.parse(text)) for t in assigned(node)
            if isinstance(t, ast.Attribute) and t.attr in attrs
            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))]


def test_the_fleet_is_its_processes_behind_a_few_names():
    """The Fleet keeps at most 12 public data attributes (the rest is private or the run's Progress), and no other
    module assigns to any of its attributes: the steps' state is run/progress.py's record, not the fleet's."""
    attrs = class_attributes(FLEET, "Fleet")
    public = sorted(a for a in attrs if not a.startswith("_"))
    assert len(public) <= MAX_FLEET_ATTRIBUTES, f"the Fleet has {len(public)} public attributes: {public}"
    bad = [f"{path.relative_to(PKG.parent)}:{w}" for name, path in modules().items() if path != FLEET
           for w in writes_to_others(path.read_text(), attrs)]
    assert not bad, "assignments to the Fleet's attributes from outside it:\n" + "\n".join(bad)


def test_the_fleet_checks_find_what_they_should():
    text = "def f(fleet, self):\n    fleet.version = 1\n    fleet.refits[:] = []\n    a, fleet.store = 1, 2\n" \
           "    fleet.trained += 1\n    self.version = 2\n    other.name = 3\n"
    found = sorted(writes_to_others(text, {"version", "refits", "store", "trained"}))
    assert found == ["2: fleet.version", "3: fleet.refits", "4: fleet.store", "5: fleet.trained"], found


def ports() -> dict[str, set[str]]:
    """Each protocol of faults/ports.py and the names it declares."""
    out = {}
    for node in ast.parse(PORTS.read_text()).body:
        if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases):
            out[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} | {
                t.id for n in node.body for t in assigned(n) if isinstance(t, ast.Name)}
    return out


def port_misuse(text: str, known: dict[str, set[str]]) -> list[str]:
    """In `text`: a parameter named `fleet`, or a use of a parameter typed by a port beyond what the port declares."""
    bad = []
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        typed = {}
        for a in fn.args.args + fn.args.kwonlyargs:
            if a.arg == "fleet":
                bad.append(f"{fn.lineno}: {fn.name}({a.arg}) takes the whole fleet; type it by a port of faults/ports.py")
            elif isinstance(a.annotation, ast.Name) and a.annotation.id in known:
                typed[a.arg] = known[a.annotation.id]
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed \
                    and node.attr not in typed[node.value.id]:
                bad.append(f"{node.lineno}: {ast.unparse(node)} is not in the port")
    return bad


def test_faults_see_the_fleet_only_through_their_ports():
    """faults/ (below driver/ in the layers, so it imports none of it) takes no fleet: each handler is typed by a
    protocol of faults/ports.py and uses only what it declares; it names none of the Fleet's data attributes on
    any object but its own; and the Fleet implements every port, method by method with the same parameters."""
    known = ports()
    assert set(known) >= {"RolloutSlots", "TrainGroup"}, known
    fleet_data = class_attributes(FLEET, "Fleet")
    for path in sorted((PKG / "faults").glob("*.py")):
        text = path.read_text()
        assert not port_misuse(text, known), f"{path.name}: " + "; ".join(port_misuse(text, known))
        named = {f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(text))
                 if isinstance(node, ast.Attribute) and node.attr in fleet_data
                 and not (isinstance(node.value, ast.Name) and node.value.id == "self")}
        assert not named, f"{path.name} names the Fleet's attributes: {sorted(named)}"
    import inspect

    from dataplane_rl.driver.fleet import Fleet
    from dataplane_rl.faults import ports as port_module

    for name in known:
        port = getattr(port_module, name)
        for member, fn in vars(port).items():
            if inspect.isfunction(fn) and not member.startswith("_"):
                assert list(inspect.signature(getattr(Fleet, member)).parameters) == list(inspect.signature(fn).parameters), \
                    f"Fleet.{member} does not match {name}.{member}"


def test_the_port_check_finds_what_it_should():
    known = {"Slots": {"actors", "where"}}
    text = ("def a(fleet): pass\n"
            "def b(slots: Slots, other):\n    slots.actors(); slots.where(1); slots._rollout; other.x\n")
    assert port_misuse(text, known) == ["1: a(fleet) takes the whole fleet; type it by a port of faults/ports.py",
                                        "3: slots._rollout is not in the port"]


# ---- reflection: another object's state reached by computed names or through its __dict__ -------------------
# A computed name (getattr(x, name)), a write by setattr, or x.__dict__ / vars(x) can reach any attribute, private
# ones included, where the private-name check above cannot see it. Each use on an object other than self or cls
# is listed here with why it is safe: (module, the call or expression as written) -> why.
REFLECTION = {
    ("dataplane_rl.driver.transport", "getattr(w, method)"): "a Ray actor method by name: the step's phases name it",
    ("dataplane_rl.driver.fleet", "getattr(w, method)"): "a Ray actor method by name (call_ranks' callers name it)",
    ("dataplane_rl.faults.rollout_actors", "getattr(a, method)"): "a Ray actor method by name (call_rollouts)",
    ("dataplane_rl.store.ray_store", "getattr(self._catalog, method)"): "the catalog actor's method by name",
    ("dataplane_rl.tasks", "getattr(self.task, name)"): "the user's task: a method the Task protocol declares",
    ("dataplane_rl.tasks.prompts", "getattr(self.task, method)"): "the user's task: a method the Task protocol declares",
    ("dataplane_rl.tasks.user_code", "getattr(import_user_module(where, key), name, None)"):
        "the function a config key names in the user's module",
    ("dataplane_rl.store", "getattr(importlib.import_module(module), cls)"): "a backend class from the URL table",
    ("dataplane_rl.model.shared_weights", "getattr(torch, name.removeprefix('torch.'), None)"):
        "a torch dtype by its name in a weights file's header",
    ("dataplane_rl.checkpoint.files", "getattr(torch, name, None)"): "a torch dtype the unpickler allows",
    ("dataplane_rl.checkpoint.files", "getattr(torch, name)"): "the same, once allowed",
    ("dataplane_rl.rollout.multiturn", "getattr(res, a, None)"): "an environment step's public result fields",
    ("dataplane_rl.schema.binding", "getattr(node, part, _MISSING)"): "a config key's dotted path, checked per part",
    ("dataplane_rl.driver.preflight", "getattr(task, name, None)"): "the task's optional public pools",
    ("dataplane_rl.bench.store_args", "getattr(args, flag, 1)"): "argparse's namespace, by flag",
    ("dataplane_rl.bench.store_args", "getattr(args, flag)"): "argparse's namespace, by flag",
    ("dataplane_rl.bench.store_args", "getattr(args, flag, 0)"): "argparse's namespace, by flag",
    ("dataplane_rl.store.mooncake.buffers", "getattr(self._tl, name, None)"): "the store's own thread-local buffers",
    ("dataplane_rl.store.mooncake.buffers", "setattr(self._tl, name, new)"): "the store's own thread-local buffers",
    ("dataplane_rl.store.arrow", "schema.__dict__"): "a frozen pydantic schema: its scan cache goes beside the fields",
}
REFLECTIVE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def reflective_uses(text: str) -> list[tuple[int, str]]:
    """Every computed-name getattr/setattr/hasattr/delattr, setattr of a private name, x.__dict__ and vars(x) in
    `text` whose object is not self or cls: (line, the expression)."""
    def own(x: ast.expr) -> bool:
        return isinstance(x, ast.Name) and x.id in ("self", "cls")

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args and not own(node.args[0]):
            fn, args = node.func.id, node.args
            if fn == "vars":
                found.append((node.lineno, ast.unparse(node)))
            elif fn in REFLECTIVE_CALLS and len(args) >= 2:
                name = args[1]
                constant = isinstance(name, ast.Constant) and isinstance(name.value, str)
                dunder = constant and name.value.startswith("__") and name.value.endswith("__")  # a protocol check
                if not constant or (fn != "getattr" and name.value.startswith("_") and not dunder):
                    found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr == "__dict__" and not own(node.value):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_reaches_another_objects_state_by_reflection():
    """A computed getattr, a setattr, vars() or __dict__ on another object is a private read the check above cannot
    see: each one is listed in REFLECTION with why it is safe, and every listed one is still used."""
    used, bad = set(), []
    for name, path in modules().items():
        for line, expr in reflective_uses(path.read_text()):
            key = next((k for k in REFLECTION if k[0] == name and k[1] == expr), None)
            if key is None:
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {expr}")
            used.add(key)
    assert not bad, ("another object's state reached by reflection; ask through a public method, or list it in "
                     "REFLECTION with why:\n" + "\n".join(bad))
    assert not set(REFLECTION) - used, f"listed but no longer used: {sorted(set(REFLECTION) - used)}"


def test_the_reflection_check_finds_what_it_should():
    text = ("def f(self, fleet, name):\n"
            "    getattr(fleet, name); setattr(fleet, '_x', 1); fleet.__dict__['v'] = 2; vars(fleet)\n"
            "    getattr(self, name); setattr(self, '_y', 1); self.__dict__; getattr(fleet, 'ok'); vars()\n"
            "    setattr(fleet, 'public', 3); hasattr(fleet, name)\n")
    found = sorted(e for _, e in reflective_uses(text))
    assert found == ["fleet.__dict__", "getattr(fleet, name)", "hasattr(fleet, name)", "setattr(fleet, '_x', 1)",
                     "vars(fleet)"], found
