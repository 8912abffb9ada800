"""README's and the documentation's examples run as written, so that they cannot drift from the code.

Every ```python block of README.md and of every page under docs/ runs as a script of its own, in an empty temporary folder, in a fresh
interpreter (this checkout's moelens first on its path), and must exit 0. Every `moelens ...` command in a
shell block (```bash, ```sh or a plain ``` fence; after a `$ ` prompt where the block shows one) runs as
`python -m moelens ...` the same way.

A block that cannot run here says so on the line right before its fence, with the reason:

    <!-- not run: needs the Hub and two GPUs -->

Such a block must still compile, and every name it uses must be bound: by the block itself, by an earlier
Python block of the same page (read top to bottom, as one session), or by Python's builtins. A block that needs an
optional extra that is not installed here (sae-lens, ...) is skipped, naming the package.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import symtable
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
SHELL = {"", "bash", "sh", "shell", "console"}
TIMEOUT = 600  # seconds per block: the SAE example trains for a few seconds; a loaded CI machine is slower


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, where README marks the block

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def read_blocks(text: str, page: str = "README.md") -> list[Block]:
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise AssertionError(f"{page}:{i + 1}: a code fence that is never closed")
        marker = NOT_RUN.match(lines[i - 1]) if i else None
        blocks.append(Block(page, i + 1, fence["lang"], "\n".join(lines[i + 1:end]) + "\n", marker and marker["reason"]))
        i = end + 1
    return blocks


BLOCKS = [b for path in PAGES for b in read_blocks(path.read_text(), str(path.relative_to(ROOT)))]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
README_PYTHON = [b for b in PYTHON if b.page == "README.md"]


def moelens_commands(block: Block) -> list[list[str]]:
    """The `moelens ...` commands of a shell block, as argument lists (continuations joined, comments and
    output lines dropped, `a && b` split)."""
    lines = block.code.replace("\\\n", " ").split("\n")
    prompted = any(line.startswith("$ ") for line in lines)
    commands = []
    for line in lines:
        if prompted:
            if not line.startswith("$ "):
                continue  # the command's output
            line = line[2:]
        if not re.search(r"(^|&&|\|\||;)\s*moelens\s", line):
            continue  # no moelens command (plain fences also hold text: the layout, a command's output)
        words = shlex.split(line, comments=True)
        segment: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", "||", ";", "|"):
                if segment and segment[0] == "moelens":
                    commands.append(segment)
                segment = []
            else:
                segment.append(word)
    return commands


COMMANDS = [(b, c) for b in BLOCKS if b.lang in SHELL for c in moelens_commands(b)]


def first_of_each(items: list, key) -> list:
    """The items whose key no earlier item has: an example shown on two pages (README's first, say) runs once."""
    seen, out = set(), []
    for item in items:
        if key(item) not in seen:
            seen.add(key(item))
            out.append(item)
    return out


RUN_PYTHON = first_of_each([b for b in PYTHON if not b.not_run], key=lambda b: b.code)
RUN_COMMANDS = first_of_each([(b, c) for b, c in COMMANDS if not b.not_run], key=lambda bc: tuple(bc[1]))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """This checkout's moelens first; the embedded defaults built once for all blocks (or the caller's cache)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    environment.setdefault("MOELENS_CACHE", str(tmp_path_factory.mktemp("moelens-cache")))
    environment["MPLBACKEND"] = "Agg"
    return environment


def run(args: list[str], cwd: Path, env: dict, what: str) -> None:
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {TIMEOUT} s")
    assert done.returncode == 0, f"{what} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"


def missing_extra(code: str) -> str | None:
    """The first package the block imports at its top level that is not installed here."""
    for node in ast.parse(code).body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            if importlib.util.find_spec(name.split(".")[0]) is None:
                return name.split(".")[0]
    return None


# ---- the blocks run -------------------------------------------------------------------------------------------


def test_readme_has_examples():
    assert [b for b in README_PYTHON if not b.not_run] and COMMANDS


def test_every_page_of_the_docs_is_read():
    """The pages the examples are read from are the site's pages (a page moved out of docs/ would be left out)."""
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/getting-started.md", "docs/routing.md", "docs/traces.md", "docs/sae-lens.md"} <= pages


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN_PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path, env):
    package = missing_extra(block.code)
    if package:
        pytest.skip(f"{block.id} needs {package}, not installed here (an optional extra)")
    script = tmp_path / "example.py"
    script.write_text(block.code)
    run([sys.executable, str(script)], tmp_path, env, f"the Python block at {block.id}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "block, command", RUN_COMMANDS, ids=lambda x: x.id if isinstance(x, Block) else " ".join(x)
)
def test_moelens_command_runs(block, command, tmp_path, env):
    run([sys.executable, "-m", "moelens", *command[1:]], tmp_path, env, f"`{shlex.join(command)}` at {block.id}")


# ---- blocks that cannot run here still hold together -------------------------------------------------------------


def bound_names(code: str) -> set[str]:
    """Names a block binds at its top level (assignments, imports, definitions; `import *` resolved)."""
    table = symtable.symtable(code, "<block>", "exec")
    names = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            module = import_or_skip(node.module)
            names |= set(getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]))
    return names


def import_or_skip(name: str):
    """The module; a skip where it needs a package that is not installed here (an optional extra), but a
    failure where a moelens module itself is missing (a module README names that moved or was renamed)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] == "moelens":
            raise AssertionError(f"an example imports {name}, which does not exist: {err}") from err
        pytest.skip(f"{name} needs {err.name}, not installed here (an optional extra)")


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_what_a_block_imports_from_moelens_exists(block):
    """Every `from moelens... import name` of every block, run or not, names a module and a name moelens has."""
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "moelens":
            module = import_or_skip(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    import_or_skip(f"{node.module}.{alias.name}")  # a submodule
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "moelens":
                    import_or_skip(alias.name)


def free_names(code: str) -> set[str]:
    """Names a block reads that no scope inside it binds: at its top level, any name read; inside its functions,
    lambdas and comprehensions, the names they read as globals."""
    used: set[str] = set()
    tables = [symtable.symtable(code, "<block>", "exec")]
    while tables:
        table = tables.pop()
        top = table.get_type() == "module"
        used |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (top or s.is_global())}
        tables.extend(table.get_children())
    return used - bound_names(code)


@pytest.mark.parametrize("block", [b for b in PYTHON if b.not_run], ids=lambda b: b.id)
def test_a_block_not_run_compiles_and_binds_its_names(block):
    compile(block.code, block.id, "exec")
    earlier = set().union(*(bound_names(b.code) for b in PYTHON if b.page == block.page and b.line < block.line))
    unbound = free_names(block.code) - earlier - set(dir(builtins))
    assert not unbound, f"{block.id} ({block.not_run}) uses names nothing binds: {sorted(unbound)}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_marker_stands_right_before_a_fence(path):
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if NOT_RUN.match(line) or "not run" in line and line.lstrip().startswith("<!--"):
            assert NOT_RUN.match(line) and i + 1 < len(lines) and FENCE.match(lines[i + 1]), (
                f"{path.relative_to(ROOT)}:{i + 1}: a 'not run' marker must be `<!-- not run: REASON -->` on the line right before "
                "a code fence"
            )


def test_an_example_on_two_pages_runs_once():
    """Only a repeated block is left out: every distinct runnable block of every page is run."""
    assert {b.code for b in RUN_PYTHON} == {b.code for b in PYTHON if not b.not_run}
    twice = [Block("a.md", 1, "python", "x = 1\n", None), Block("b.md", 5, "python", "x = 1\n", None)]
    assert first_of_each(twice, key=lambda b: b.code) == twice[:1]


def test_the_name_check_catches_a_missing_import():
    """The check above can fail: a block that uses an API function it never imports."""
    code = "from moelens.analysis import usage\nablate_experts(model, tokens, [1])\n"
    assert free_names(code) - set(dir(builtins)) == {"ablate_experts", "model", "tokens"}
    assert free_names("import torch\nf = lambda x: torch.relu(x) + y\n") == {"y"}


# ---- installing: moelens is installed from a checkout, not from a package index ----------------------------------


BY_NAME = re.compile(r"""pip install\s+(?:-\w+\s+)*['"]?moelens(?:\[[\w,-]*\])?['"]?(?=[\s`'"),;]|$)""", re.MULTILINE)
FROM_CHECKOUT = re.compile(r"""pip install\s+(?:-\w+\s+)*['"]?\.\[(?P<extras>[\w,-]+)\]""")


def test_pip_install_names_moelens_by_its_path():
    """moelens is not on a package index: `pip install "moelens[sae]"` fails on a new machine. README (and the
    commands' messages) install it from the checkout, `pip install ".[sae]"`, naming extras pyproject.toml has."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for path in (*PAGES, ROOT / "moelens" / "cli.py"):
        text = path.read_text()
        by_name = [m.group(0) for m in BY_NAME.finditer(text)]
        assert not by_name, f"{path.name}: {by_name}: install moelens from its checkout, `pip install '.[extra]'`"
        for match in FROM_CHECKOUT.finditer(text):
            unknown = set(match["extras"].split(",")) - extras
            assert not unknown, f"{path.name}: `{match.group(0)}`: pyproject.toml has no extra {sorted(unknown)}"
    assert BY_NAME.search('pip install "moelens[sae]"') and BY_NAME.search("pip install moelens")
    assert not BY_NAME.search('pip install ".[sae]"') and not BY_NAME.search("pip install moelens-extra")


# ---- the project's files speak of the project ------------------------------------------------------------------

PROCESS_WORDS = re.compile(r"\blent\b|\bsessions?\b|run\(\{|\btimeout_s\b|command limit|device run", re.IGNORECASE)


def test_docs_and_scripts_speak_of_the_project():
    """README, the benchmarks, tools and CI script describe how to run things on a machine, not how the project
    happens to be developed."""
    files = [*PAGES, ROOT / ".ci" / "run", ROOT / "mkdocs.yml", *(ROOT / "benchmarks").iterdir(), *(ROOT / "tools").glob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files if path.is_file()
        for n, line in enumerate(path.read_text().split("\n"), 1) if PROCESS_WORDS.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_first_example_moves_exactly_the_tokens_routed_to_the_ablated_expert():
    """README's first block ablates one expert of the last block: the change it prints is non-zero at the
    tokens routed to that expert and exactly zero elsewhere (and some token is routed to it)."""
    first = README_PYTHON[0]
    expert = int(re.search(r"masked_fill\(chosen == (\d+), 0\)", first.code).group(1))
    layer = int(re.search(r"blocks\.(\d+)\.mlp\.hook_expert_weights", first.code).group(1))
    names: dict = {}
    exec(compile(first.code, first.id, "exec"), names)  # noqa: S102 (README's own example)
    assert layer == names["model"].cfg.n_layers - 1  # the last block: no later block spreads the change
    change = (names["ablated"] - names["logits"]).abs().amax(-1)
    routed = (names["chosen"] == expert).any(-1)
    assert routed.any() and not routed.all(), f"the example's prompt routes {routed.sum()} tokens to expert {expert}"
    assert torch.equal(change != 0, routed), (change, routed)
