"""The README and every page of docs/, run as a user would: every `dataplane-rl ...` command line and every
Python block; and every link between them resolves.

Blocks run top to bottom, README.md first, then docs/*.md in name order, each a subprocess, in one temporary
working directory that looks like a checkout (its files linked in, no `runs/`), so a later block may use
what an earlier one made (`runs/latest`). A block preceded by `<!-- readme-test: skip (REASON) -->` does not run; the marker is
only for blocks that need a Ray cluster, several hosts or a GPU. A block preceded by
`<!-- readme-test: run by TESTFILE (REASON) -->` (a file under tests/) runs there instead, as written, with that
file's checks on its output (the real model's training command, the whole default runs, whose run a second time here would cost CI
minutes); the file must read the block from its page.

What runs: in a shell block (bash, or a console block whose lines start with `$ `), each command line
(`\\`-continued lines joined, `# comments` dropped) is split on `&&`, and every part whose program is
`dataplane-rl` (or a path ending in /dataplane-rl) runs through bash, with the CLI of this checkout's
interpreter. Other programs (pip, apt-get, ray, python -m pytest) are the user's setup and do not run.
`train` gets a tiny budget appended as overrides (small batches; one step, unless the command itself
names at most MAX_STEPS steps, as a checkpoint/resume/export sequence must), and joins this session's
Ray instead of starting its own. In a console block, the lines after a command are its expected output: they must
appear in what it prints; an expected `error:` means exit status 2. A `generation.backend=vllm`
command without vllm installed must be refused with the install hint, before Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the README first: later pages may use its runs
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
RUN_BY = re.compile(r"<!--\s*readme-test:\s*run by (?P<test>tests/\S+\.py)\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
SHELL = {"bash", "sh", "shell", "console", ""}
# a train command's budget: steps of 2 prompts x 2 samples, short responses (any dp_size up to 2), and one
# step unless the command names a small step count itself (a checkpoint/resume/export sequence needs its own)
TRAIN_BUDGET = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
                "policy.train_global_batch_size=4", "policy.train_micro_batch_size=2", "generation.max_new_tokens=4"]
MAX_STEPS = 10
TIMEOUT_S = 300
# what a block that needs a Ray cluster, other hosts or a GPU names: ray start, a cluster address, the head
# node, CUDA, a daemon's pid file, the Mooncake master
NEEDS_CLUSTER_OR_GPU = re.compile(r"ray start|cluster\.address|--address|\bHEAD\b|cuda|\.pid\b|mooncake_master")


@dataclass
class Block:
    lang: str
    line: int                      # 1-based line of the opening fence
    text: str
    skip: str | None = None        # the marker's reason
    commands: list[tuple[str, list[str]]] = field(default_factory=list)  # (command line, expected output lines)
    page: str = "README.md"        # the file, relative to the checkout
    run_by: str | None = None      # the test file that runs it instead (RUN_BY)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}-{self.lang or 'text'}"


def parse_blocks(markdown: str, page: str = "README.md") -> list[Block]:
    blocks, lines, i = [], markdown.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP.search(before)
        block = Block(m["lang"], start + 1, "\n".join(body) + "\n", marker["reason"] if marker else None, page=page)
        run_by = RUN_BY.search(before)
        block.run_by = run_by["test"] if run_by else None
        if block.lang in SHELL:
            block.commands = shell_commands(body, block.lang)
        blocks.append(block)
    return blocks


def strip_comment(text: str) -> str:
    """The line without its `# comment` (a # outside quotes, at the start or after a space)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i]
    return text


def words(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # not shell (an unbalanced quote): it is no command of ours either
        return text.split()


def shell_commands(body: list[str], lang: str = "bash") -> list[tuple[str, list[str]]]:
    """(command line, expected output) per command; a console block (`$ ` lines) carries its output.
    A plain block without `$ ` lines is text (a diagram, a formula), not commands."""
    console = any(line.startswith("$ ") for line in body)
    if lang in ("", "console") and not console:
        return []
    out: list[tuple[str, list[str]]] = []
    pending = ""
    for line in body:
        if console and not line.startswith("$ "):
            if out and not pending:
                out[-1][1].append(line.rstrip())
            continue
        text = line[2:] if console else line
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1].strip() + " "
            continue
        text = text.strip() if pending else text
        text, pending = strip_comment(pending + text).strip(), ""
        if text:
            out.append((text, []))
    return [(cmd, [x for x in expected if x.strip()]) for cmd, expected in out]


def is_cli(part: str) -> bool:
    w = words(part)
    return bool(w) and (w[0] == "dataplane-rl" or w[0].endswith("/dataplane-rl"))


def runnable(command: str) -> list[str]:
    """The `dataplane-rl` parts of a command line (split on &&), as they are to run."""
    return [p.strip() for p in command.split("&&") if is_cli(p.strip())]


def prepare(part: str, ray_address: str | None) -> tuple[str, list[str]]:
    """(bash command, its argv words): this interpreter's CLI, and for train the budget and the shared Ray."""
    head, pipe, tail = part.partition("|")
    argv = words(head)[1:]
    if argv and argv[0] == "train":
        steps = [w.split("=", 1)[1] for w in argv if w.startswith("grpo.max_num_steps=")]
        small = bool(steps) and steps[-1].isdigit() and int(steps[-1]) <= MAX_STEPS
        budget = TRAIN_BUDGET + ([] if small else ["grpo.max_num_steps=1"])
        keys = {w.split("=", 1)[0] for w in budget}  # in place of the page's own: a command line sets a key once
        argv = [w for w in argv if w.split("=", 1)[0] not in keys] + budget
        if ray_address and not any(w.startswith("cluster.address=") for w in argv):
            argv.append(f"cluster.address={ray_address}")  # one Ray start for every command, not one each
    cli = f"{shlex.quote(sys.executable)} -m dataplane_rl.cli.main"
    return " ".join([cli, *map(shlex.quote, argv)]) + (f" |{tail}" if pipe else ""), argv


BLOCKS = [b for page in PAGES for b in parse_blocks(page.read_text(), str(page.relative_to(ROOT)))]
RUN = [b for b in BLOCKS if b.skip is None and b.run_by is None
       and (b.lang == "python" or any(runnable(c) for c, _ in b.commands))]


def block_at(page: str, marker: str) -> Block:
    """The one block of `page` preceded by a `run by` marker naming `marker` (a test file): what that file runs."""
    found = [b for b in BLOCKS if b.page == page and b.run_by == marker]
    assert len(found) == 1, f"{page} has {len(found)} blocks marked `readme-test: run by {marker}`, not one"
    return found[0]


def page_command(page: str, testfile: str) -> list[str]:
    """The one `dataplane-rl train` command of the block of `page` that `testfile` runs (a `run by` marker), as
    the page writes it: its words after `dataplane-rl`."""
    (part,) = [part for command, _ in block_at(page, testfile).commands for part in runnable(command)]
    argv = words(part)
    assert argv[:2] == ["dataplane-rl", "train"], part
    return argv[1:]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, ray_session) -> tuple[Path, dict, str]:
    """A fresh folder that looks like the checkout, where the README's commands run in order."""
    cwd = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name != "runs":
            (cwd / entry.name).symlink_to(entry)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
    yield cwd, env, ray_session.get_runtime_context().gcs_address
    for store in cwd.glob("runs/*/summary.json"):  # a kept store the README did not drop
        url = json.loads(store.read_text()).get("kept_store_url")
        if url and url.startswith("shm://") and Path(url[len("shm://"):].split("?")[0]).is_dir():
            subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "drop", url, "--all"], env=env,
                           capture_output=True, timeout=120)


def check_expected(command: str, expected: list[str], p: subprocess.CompletedProcess) -> None:
    shown = [line.rstrip() for line in (p.stdout + p.stderr).splitlines()]
    missing = [line for line in expected if line not in shown]
    assert not missing, f"`{command}`: the page shows lines it did not print: {missing}\n--- it printed:\n" \
                        + "\n".join(shown[-40:])


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_readme_block(block: Block, workdir):
    cwd, env, ray_address = workdir
    if block.lang == "python":
        p = subprocess.run([sys.executable, "-c", block.text], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        assert p.returncode == 0, f"{block.id}: the Python block failed\n{p.stderr[-3000:]}"
        return
    for command, expected in block.commands:
        for part in runnable(command):
            script, argv = prepare(part, ray_address)
            p = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT_S)
            if "generation.backend=vllm" in argv and importlib.util.find_spec("vllm") is None:
                # the extra is not installed here: the run must say so, before Ray, in one line
                assert p.returncode == 2 and "install the `vllm` extra" in p.stderr, p.stderr[-3000:]
                assert "Traceback" not in p.stderr and "ActorDiedError" not in p.stderr, p.stderr[-3000:]
                continue
            wants_error = any(line.startswith("error:") for line in expected)
            assert p.returncode == (2 if wants_error else 0), \
                f"{block.id}: `{part}` exited {p.returncode}\n{p.stderr[-3000:]}"
            check_expected(part, expected, p)


def test_readme_parser_finds_the_commands():
    """The extractor itself: it finds commands in every kind of block, so a README edit cannot slip past it."""
    commands = [c for b in BLOCKS for c, _ in b.commands]
    assert "pip install -e . && dataplane-rl train" in commands
    assert runnable("pip install -e . && dataplane-rl train") == ["dataplane-rl train"]
    assert runnable("/opt/venv-vllm/bin/dataplane-rl train generation.backend=vllm")
    assert not runnable("python -m pytest -q") and not runnable("apt-get update")
    assert any(b.lang == "python" for b in RUN)
    # continuation lines are joined and comments dropped
    assert shell_commands(["dataplane-rl train a=1 \\", "    b=2   # two keys"]) == [("dataplane-rl train a=1 b=2", [])]
    assert shell_commands(["pip install '.[x]'  # quoted"]) == [("pip install '.[x]'", [])]
    assert shell_commands(["driver  get DRIVER_FIELDS"], "") == []  # a diagram, not a command
    # a console block: the lines after `$ cmd` are its output
    assert shell_commands(["$ dataplane-rl x", "out 1", "", "$ dataplane-rl y"]) == [
        ("dataplane-rl x", ["out 1"]), ("dataplane-rl y", [])]
    script, argv = prepare("dataplane-rl train --config c.yaml k=v | tail -1", "1.2.3.4:5")
    assert argv[:3] == ["train", "--config", "c.yaml"] and "grpo.max_num_steps=1" in argv
    assert "grpo.max_num_steps=1" not in prepare("dataplane-rl train grpo.max_num_steps=4", None)[1]
    assert prepare("dataplane-rl train grpo.max_num_steps=30", None)[1][-1] == "grpo.max_num_steps=1"
    assert argv[-1] == "cluster.address=1.2.3.4:5" and script.endswith("| tail -1")


def test_skip_markers_are_for_clusters_and_gpus_only():
    for b in BLOCKS:
        if b.skip is not None:
            assert re.search(r"cluster|GPU|host|node", b.skip, re.IGNORECASE), \
                f"{b.id} is skipped for '{b.skip}': the marker is only for blocks that need a cluster, hosts or a GPU"
        if b.skip is not None:  # and the block it skips really needs one (a marker misplaced by a merge fails)
            assert NEEDS_CLUSTER_OR_GPU.search(b.text), f"{b.id} is skipped for '{b.skip}' but needs no cluster or GPU"
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        markers = [line for line in page.read_text().splitlines() if SKIP.fullmatch(line.strip())]
        assert len(markers) == sum(b.skip is not None for b in BLOCKS if b.page == name), \
            f"{name}: a skip marker that is not directly before a fenced block skips nothing"
        markers = [line for line in page.read_text().splitlines() if RUN_BY.fullmatch(line.strip())]
        assert len(markers) == sum(b.run_by is not None for b in BLOCKS if b.page == name), \
            f"{name}: a `run by` marker that is not directly before a fenced block hands nothing over"


def test_a_block_run_elsewhere_is_run_there():
    """A `run by` block is a command line of this CLI, and the test file it names exists and reads it from its page
    (block_at), so the page's command is the one that runs."""
    handed = [b for b in BLOCKS if b.run_by is not None]
    assert handed, "docs/models.md's real-model command is run by tests/test_real_model.py"
    for b in handed:
        assert b.commands and all(runnable(c) for c, _ in b.commands), f"{b.id}: no dataplane-rl command to run"
        source = (ROOT / b.run_by).read_text()
        assert ("block_at(" in source or "page_command(" in source) and f'"{b.page}"' in source \
            and f'"{b.run_by}"' in source, \
            f"{b.id}: {b.run_by} does not read this block (block_at or page_command, with its page and its own name)"


def test_apt_install_updates_the_package_lists_first():
    """On a fresh machine `apt-get install` fails without package lists: every install line updates first."""
    for b in BLOCKS:
        for command, _ in b.commands:
            if "apt-get install" in command:
                assert "apt-get update" in command.split("apt-get install")[0], f"{b.id}: `{command}`"


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", m[1].strip().lower())))
    return out


def broken_links(page: Path) -> list[str]:
    """Every relative link or image of a page whose file (or #anchor in it) does not exist."""
    bad = []
    for m in LINK.finditer(page.read_text()):
        target = m["target"]
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are not checked (no network here)
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            bad.append(f"{target} (no heading #{anchor} in {file.name})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page: Path):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links {broken_links(page)}"


def test_link_checker_finds_broken_links(tmp_path):
    """The checker itself: a missing file and a missing anchor are found, good links and URLs pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Store API and guarantees\n## Its `keys`\n")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/a.md) [b](docs/a.md#store-api-and-guarantees) [c](docs/a.md#its-keys) "
                    "[d](https://example.org/x) ![e](docs/none.png) [f](docs/a.md#nowhere) [g](#top)\n# Top\n")
    assert broken_links(page) == ["docs/none.png (no such file)", "docs/a.md#nowhere (no heading #nowhere in a.md)"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / m["target"].partition("#")[0]).resolve() for m in LINK.finditer(README.read_text())}
    assert not [p.name for p in PAGES[1:] if p.resolve() not in linked], "a docs page the README's map does not name"


# The docs are a product, not a diary: a front door of bounded size, the current figures only (their history is in
# git), and no text that names an issue or a round of work instead of saying what a thing does and why.
README_MAX_LINES, BENCHMARKS_MAX_LINES, README_MAX_CELL = 220, 600, 300
HISTORY = re.compile(r"\bissues? ?#?\d+|\bissue-\d+|\bround[- ]?\d+ probe|\bprobe rounds?\b|\brounds? of work\b|"
                     r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) session\b|"
                     r"\bthe round before\b", re.IGNORECASE)
# every text of the repository but this file, which holds the pattern's own examples
PRODUCT_TEXT = [*PAGES, *sorted((ROOT / "dataplane_rl").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
                *sorted(p for p in (ROOT / "scripts").glob("*") if p.is_file()), ROOT / ".ci" / "run",
                *sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name)]


def test_docs_stay_a_product():
    readme = README.read_text().splitlines()
    assert len(readme) <= README_MAX_LINES, \
        f"README.md has {len(readme)} lines (at most {README_MAX_LINES}): move detail to the docs page it belongs to"
    bench = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(bench) <= BENCHMARKS_MAX_LINES, \
        f"docs/benchmarks.md has {len(bench)} lines (at most {BENCHMARKS_MAX_LINES}): keep each benchmark's " \
        "current figures, their meaning and the command; earlier runs stay in git"
    wide = [(n, len(cell.strip())) for n, line in enumerate(readme, 1) if line.startswith("|")
            for cell in line.strip().strip("|").split("|") if len(cell.strip()) > README_MAX_CELL]
    assert not wide, f"README.md table cells over {README_MAX_CELL} characters (line, length): {wide}"


def test_no_text_names_an_issue_or_a_round_of_work():
    found = [f"{path.relative_to(ROOT)}:{n}: {m[0]!r}" for path in PRODUCT_TEXT
             for n, line in enumerate(path.read_text().splitlines(), 1) for m in [HISTORY.search(line)] if m]
    assert not found, "say what the thing does and why, not which issue or round of work brought it:\n" + "\n".join(found)


def test_history_pattern_finds_what_it_means_only():
    for text in ("issue 36", "(issue 28)", "Issue #47", "the issue-47 session", "round 3 probe", "the round-3 probe",
                 "sixth session", "a probe round", "two rounds of work", "the round before"):
        assert HISTORY.search(text), text
    for text in ("the worker's Ray session logs", "a put session", "a session of its own", "Round 0 is cold",
                 "its round-0 batch", "the port probe", "a steady round", "dynamic (4096, round 64)",
                 "this session's Ray", "an ssh session"):
        assert not HISTORY.search(text), text
