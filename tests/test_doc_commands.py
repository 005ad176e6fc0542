"""Every shell command in README.md and docs/*.md runs as written and ends as the page says.

Each fenced bash, sh, shell or console block is one test: its commands run one after another,
each in its own `bash -c` and verbatim, in a scratch directory of the block's own, with the
venv's `rtrain` first on PATH, and HOME and TMPDIR inside the scratch dir. The directory holds
a copy of examples/ and, where the block names a script of the reader's own (`train.py`,
`run_clm.py`), a stand-in from tests/doc_scripts/ under that name: the vision example with a
short rtrain.toml for a plain `train.py`, and scripts shaped like nanoGPT's, Lightning's or the
Hugging Face Trainer's for the blocks about those. A command must exit 0, or N where its
comment says `# exits N`.

Not read: the records (chaos-results.md, soak-results.md, test-coverage.md). Commands that need
what a test machine lacks are in NOT_RUN with the reason, and the list may name only commands the
pages still hold.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import REPO, child_env, run_child

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_PAGES = {"chaos-results.md", "soak-results.md", "test-coverage.md"}
SHELLS = {"bash", "sh", "shell", "console"}
STAND_INS = REPO / "tests" / "doc_scripts"

# A command that starts with one of these is not run, for the reason given.
NOT_RUN = {
    "scripts/demo.sh": "installs rtrain into the checkout's .venv (pip install -e .), under the "
                       "tests running from it; the run it makes is the README's RTRAIN_FAULTS "
                       "command, which runs here",
    "scripts/test.sh": "is the test suite itself (.ci/run runs it)",
    "rtrain launch --nproc-per-node 8 --nnodes 2": "needs two nodes with 8 devices each and "
                                                    "storage both see",
    "sbatch ": "needs a Slurm cluster (tests/test_slurm.py and test_slurm_multinode.py run "
               "scripts/slurm on a local one)",
    "kubectl ": "needs a Kubernetes cluster",
}
# A block whose command starts with one of these runs in the soak tier only: the default-tier
# test named runs the same command, with the same options, on a shorter run.
IN_SOAK = {
    "rtrain check-resume examples/vision/train.py --config examples/vision/rtrain.toml":
        "tests/test_check_resume.py::test_check_resume_says_the_vision_example_resumes_exactly",
}
TIMEOUT_S = 300  # one command; the examples train for seconds


@dataclass(frozen=True)
class Command:
    text: str
    line: int
    exit_code: int


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str
    commands: tuple[Command, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def commands(text: str, first_line: int, console: bool = False) -> list[Command]:
    """The commands of a block as bash reads them: continued lines (a trailing backslash)
    joined, comment lines and blank lines left out; in a console block, `$ ` lines only."""
    found: list[Command] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), first_line):
        line = raw
        if not pending:
            if console:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        pending.append(line)
        if not line.endswith("\\"):
            command = "\n".join(pending)
            said = re.search(r"#\s*exits (\d+)\b", command)
            found.append(Command(command, start, int(said.group(1)) if said else 0))
            pending = []
    assert not pending, f"line {start}: a command ends with a backslash and nothing after it"
    return found


def blocks(page: Path) -> list[Block]:
    out: list[Block] = []
    lang, body, opened = None, [], 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^```\s*(\S*)", line)
        if fence and lang is None:
            lang, body, opened = fence.group(1) or "", [], number
        elif line.startswith("```") and lang is not None:
            if lang in SHELLS:
                text = "\n".join(body)
                out.append(Block(page.name, opened, text,
                                 tuple(commands(text, opened + 1, lang == "console"))))
            lang = None
        elif lang is not None:
            body.append(line)
    return out


def all_blocks() -> list[Block]:
    return [b for page in PAGES if page.name not in NOT_PAGES for b in blocks(page)]


def reason_not_run(command: Command) -> str | None:
    return next((f"{start.strip()}: {why}" for start, why in NOT_RUN.items()
                 if command.text.startswith(start)), None)


def prepare(block: Block, scratch: Path) -> None:
    """The scratch dir a reader of the page would stand in: examples/ and their own scripts."""
    shutil.copytree(REPO / "examples", scratch / "examples",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (scratch / "home").mkdir()
    (scratch / "tmp").mkdir()
    if "run_clm.py" in block.text:
        shutil.copy(STAND_INS / "run_clm.py", scratch / "run_clm.py")
    layout_script = re.search(r"--(experiment|save_dir|save_folder|dump_folder)\b", block.text)
    for name in ("main.py", "checkpointing.py", "train.py"):
        if re.search(rf"(?<![\w/.]){re.escape(name)}", block.text) and (
                name != "train.py" or layout_script):
            # imagenet's, accelerate's and the other layouts' scripts (docs/foreign.md)
            shutil.copy(STAND_INS / "layout_scripts.py", scratch / name)
            shutil.copy(REPO / "tests" / "children" / "layouts_train.py", scratch)
    if re.search(r"(?<![\w/.])train\.py", block.text) and not layout_script:
        if "--init_from" in block.text:
            shutil.copy(STAND_INS / "nanogpt_train.py", scratch / "train.py")
        elif "--ckpt_path" in block.text:
            shutil.copy(STAND_INS / "lightning_train.py", scratch / "train.py")
        else:
            shutil.copy(REPO / "examples" / "vision" / "train.py", scratch / "train.py")
            (scratch / "rtrain.toml").write_text("[settings]\nsteps = 20\n")


BLOCKS = all_blocks()


def in_soak(block: Block) -> bool:
    return any(c.text.startswith(tuple(IN_SOAK)) for c in block.commands)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.soak) if in_soak(b) else b
                                   for b in BLOCKS], ids=[b.id for b in BLOCKS])
def test_doc_block_runs_as_written(block, tmp_path):
    run = [c for c in block.commands if reason_not_run(c) is None]
    if not run:
        pytest.skip("; ".join(sorted({reason_not_run(c) for c in block.commands})))
    prepare(block, tmp_path)
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "rtrain").exists(), f"no rtrain beside {sys.executable}: pip install -e ."
    # HOME inside the scratch dir, so `~/...` in a page stays there. TMPDIR is a short dir of its
    # own: a DataLoader's workers bind a unix socket under it, and a socket's path must fit in
    # 108 bytes, which pytest's per-test dirs do not leave room for.
    tmp = Path(tempfile.mkdtemp(prefix="rtdoc-"))
    env = child_env(PATH=f"{bin_dir}:{child_env()['PATH']}", HOME=str(tmp_path / "home"),
                    TMPDIR=str(tmp))
    try:
        _run_block(run, block, tmp_path, env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_block(run, block, tmp_path, env):
    for command in run:
        r = run_child(["bash", "-c", command.text], cwd=tmp_path, env=env, timeout=TIMEOUT_S)
        assert r.returncode == command.exit_code, (
            f"{block.page}:{command.line}: exit {r.returncode}, the page says "
            f"{command.exit_code}\n$ {command.text}\nstdout ends:\n{r.stdout[-3000:]}\n"
            f"stderr ends:\n{r.stderr[-3000:]}")


def test_the_pages_hold_commands():
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "foreign.md", "report.md"} <= pages
    assert sum(len(b.commands) for b in BLOCKS) >= 20


def test_every_command_of_foreign_md_runs():
    """The foreign-script page is where a drifted command costs a new user most (its Lightning
    command once exited 2): each of its commands runs, none is excused."""
    foreign = [c for b in BLOCKS if b.page == "foreign.md" for c in b.commands]
    assert len(foreign) >= 6 and not [c.text for c in foreign if reason_not_run(c)]
    assert any("--ckpt_path {checkpoint}" in c.text for c in foreign)  # the Lightning one


def test_every_command_not_run_is_still_on_a_page():
    names = [c.text for b in BLOCKS for c in b.commands]
    for start in NOT_RUN:
        assert any(n.startswith(start) for n in names), (
            f"NOT_RUN names {start!r}, which no page holds any more: remove it")
    for start in IN_SOAK:
        assert any(n.startswith(start) for n in names), (
            f"IN_SOAK names {start!r}, which no page holds any more: remove it")


def test_a_block_left_to_the_soak_tier_is_run_by_its_default_tier_test():
    """The default-tier test named for a block runs the same command and options: only the
    run's length may differ."""
    for start, test in IN_SOAK.items():
        path, name = test.split("::")
        source = (REPO / path).read_text()
        body = source[source.index(f"def {name}("):]
        body = body[:body.find("\ndef ", 1)]
        for word in start.split()[2:]:  # past `rtrain COMMAND`: the script and the options
            assert f'"{word}"' in body, f"{test} does not pass {word}"


def test_commands_are_read_as_bash_reads_them():
    text = ("# a comment\n"
            "rtrain launch train.py \\\n    --set steps=5   # supervise\n"
            "\n"
            "rtrain status rtrain-run/missing   # exits 2: no run there\n")
    assert commands(text, 10) == [
        Command("rtrain launch train.py \\\n    --set steps=5   # supervise", 11, 0),
        Command("rtrain status rtrain-run/missing   # exits 2: no run there", 14, 2)]
    console = "$ rtrain --version\nrtrain 0.1.0\n$ rtrain status   # exits 2\n"
    assert [c.text for c in commands(console, 1, console=True)] == [
        "rtrain --version", "rtrain status   # exits 2"]
