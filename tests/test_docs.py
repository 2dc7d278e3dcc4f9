"""Every code example of README.md and docs/guide.md runs, so that the docs cannot drift from the API.

What runs, per document:

- Every ```python block, in document order, in one namespace per document and one fresh temporary working
  directory per document: a block may use the names and files of the blocks before it in the same document (the
  guide's snippets use the ``h`` and ``run.thist`` of earlier ones), never those of another document. A line
  ``EXPR  # 'TEXT'`` (a comment that starts with a string literal, ``True``, ``False`` or ``None``, alone or
  followed by ``:`` and an explanation) shows what EXPR gives: it runs as ``assert EXPR == 'TEXT'``.
- Every line of a ```sh block that starts with ``trainhist``, at its place in the document and in the same
  directory, through ``trainhist.cli.main`` (in this process, the words split as a shell splits them and
  unquoted patterns expanded against the directory's files, as a shell does). It must exit 0, and print or write
  what the docs say it does (``CLAIMS`` below; README's ``trainhist triage`` line quotes the demo's triage, which
  is checked on the history ``trainhist demo`` wrote). Other lines (``make ...``) are not run. Commands too slow
  for a test run with the substitutions of ``SUBSTITUTIONS`` below, each written out there with its reason.

An HTML comment on the line before a block's fence says what the block needs (the comments do not render):

- ``<!-- doctest: needs torch, transformers -->``: the block is skipped when one of those modules is missing, as
  the torch tests are; a block that reads a file such a block wrote says so too.
- ``<!-- doctest: given gpt2 -->``: the names a training loop brings (``model``, ``batch``, ``loader``, ``opt``,
  ``scaler``, ``sched``, ``n_tokens``) are defined first, by ``_given_gpt2`` below: the demo's tiny GPT-2 (16 positions)
  and three batches of two sequences of 16 tokens.
- ``<!-- doctest: given ranks -->``: ``run.rank0.thist`` and ``run.rank1.thist`` are written first, by
  ``_given_ranks`` below: the two ranks of one run, as guide section 5 writes them.
- ``<!-- doctest: setup CODE -->``: CODE runs first, in the block's namespace (``h = trainhist.open(...)`` for a
  snippet that uses an open ``h``, as the guide says its snippets do).

Each block (and each sh block) is one test, run after the blocks before it in its document (a test run alone
runs those first); a block after a failed one fails too, naming it.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import linecache
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/guide.md")

# Documented commands run with other arguments, each for the reason given; the left side must occur in the docs.
SUBSTITUTIONS = {
    # 30 steps of 2 micro-batches of 8 sequences and the figures take about 20 s: 21 steps (the NaN is injected at
    # step 20) of 2 micro-batches of 1 sequence, without the figures (test_figures covers them), give the same
    # triage (2 NaN at step 20: one per micro-batch).
    "trainhist demo --inject-nan 20": "trainhist demo --inject-nan 20 --steps 21 --batch 1 --no-figures",
    # "my-reader" stands for another implementation, and the whole suite takes minutes (test_conformance runs it):
    # the reference implementation, run as a subprocess exactly as another one would be, on one case.
    'trainhist conformance --impl "my-reader"':
        'trainhist conformance --impl "{python} -m trainhist.conformance_impl" -k presence/segments',
}


def _readme_triage_quote() -> str:
    """The triage sentence README's ``trainhist triage`` line quotes from the demo's history."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r'^trainhist triage run\.thist +# "(.*?)" \(the demo\'s\)', text, re.M | re.S)
    assert m, "README's `trainhist triage` line no longer quotes the demo's triage"
    return re.sub(r"\s*\n\s*#\s*", " ", m.group(1))


def _lines(*starts: str):
    def check(out: str, cwd: Path, before: dict) -> None:
        heads = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
        assert all(w in heads for w in starts), (starts, out)
    return check


def _says(text: str):
    def check(out: str, cwd: Path, before: dict) -> None:
        assert text in out, (text, out)
    return check


def _json(out: str, cwd: Path, before: dict) -> None:
    assert isinstance(json.loads(out), dict), out[:200]


def _files(*names: str):
    """The command wrote these files (new, or rewritten since it started)."""
    def check(out: str, cwd: Path, before: dict) -> None:
        for n in names:
            f = cwd / n
            assert f.is_file() and before.get(n) != f.stat().st_mtime_ns, (n, sorted(_mtimes(cwd)))
    return check


def _mtimes(cwd: Path) -> dict:
    return {str(f.relative_to(cwd)): f.stat().st_mtime_ns for f in cwd.rglob("*") if f.is_file()}


def _demo_triage(out: str, cwd: Path, before: dict) -> None:
    rc, text, err = run_cli(["trainhist", "triage", "demo_out/demo.thist"])
    assert rc == 0, err
    assert _readme_triage_quote() in text, text


# What the docs say a command prints or writes (in its comment, or the prose around it), checked after it ran:
# (document, the command as written) -> check(stdout, directory, {file: mtime} before the command).
CLAIMS = {
    ("README.md", "trainhist info run.thist"): _lines("run", "writer", "segment", "steps", "sites"),
    ("README.md", "trainhist verify run.thist"): _says("run.thist: clean: "),
    ("README.md", "trainhist dump run.thist"): _json,
    ("README.md", "trainhist merge -o all.thist run.rank*.thist"): _files("all.thist"),
    ("README.md", "trainhist coarsen all.thist -o small.thist --steps 10 --bins-per-octave 2"): _files("small.thist"),
    ("README.md", "trainhist export run.thist -o tables/"):
        _files("tables/spines.parquet", "tables/steps.parquet", "tables/scalars.parquet"),
    ("README.md", "trainhist plot run.thist -o figs/"): _files("figs/contact_sheet_p1.png"),
    ("README.md", 'trainhist conformance --impl "my-reader"'): _says("1 passed, 0 failed"),  # (substituted)
    ("README.md", "trainhist demo --inject-nan 20"): _demo_triage,  # (README quotes its triage)
    ("docs/guide.md", "trainhist export run.thist -o run_tables/"):
        _files("run_tables/spines.parquet", "run_tables/steps.parquet", "run_tables/scalars.parquet"),
    ("docs/guide.md", "trainhist export run.thist -o acts.parquet --streams activation --sites 'encoder.*'"):
        _files("acts.parquet"),
    ("docs/guide.md", "trainhist export run.thist -o run_csv/ --format csv --phases pre_clip"):
        _files("run_csv/spines.csv", "run_csv/steps.csv", "run_csv/scalars.csv", "run_csv/manifests.json"),
}

_DIRECTIVE = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->\s*$")
_FENCE = re.compile(r"^```(\w*)\s*$")
_SHOWN = re.compile(r"""^(?P<indent>\s*)(?P<expr>[^#\s][^#]*?)\s+#\s*(?P<lit>'[^'\\]*'|"[^"\\]*"|True|False|None)"""
                    r"(?:$|:\s)")


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    needs: list[str] = field(default_factory=list)
    given: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}:{self.lang}"


def parse(doc: str) -> list[Block]:
    """The ```python and ```sh blocks of a document, with the doctest directives of the comments before each."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    directives: list[str] = []
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if m:
            directives.append(m.group(1))
            i += 1
            continue
        f = _FENCE.match(lines[i])
        if f:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if f.group(1) in ("python", "sh"):
                b = Block(doc, i + 1, f.group(1), "\n".join(lines[i + 1 : end]) + "\n")
                for d in directives:
                    word, _, rest = d.partition(" ")
                    if word == "needs":
                        b.needs += [x.strip() for x in rest.split(",") if x.strip()]
                    elif word == "given":
                        b.given += rest.split()
                    elif word == "setup":
                        b.setup.append(rest)
                    else:
                        raise ValueError(f"{doc}:{i}: unknown doctest directive {d!r}")
                blocks.append(b)
            elif directives:
                raise ValueError(f"{doc}:{i + 1}: doctest directive before a ```{f.group(1)} block")
            directives = []
            i = end + 1
            continue
        if lines[i].strip() and directives:
            raise ValueError(f"{doc}:{i + 1}: doctest directive not right before a code block")
        i += 1
    return blocks


def _python_source(code: str) -> str:
    """The block's code, its ``EXPR  # 'TEXT'`` lines as assertions."""
    out = []
    for ln in code.splitlines():
        m = _SHOWN.match(ln)
        if m:
            ln = f"{m['indent']}assert ({m['expr']}) == {m['lit']}, ({m['expr']})"
        out.append(ln)
    return "\n".join(out) + "\n"


def commands(code: str) -> list[str]:
    """The ``trainhist ...`` command lines of a sh block (continuation lines joined), comments kept."""
    joined = re.sub(r"\\\n", " ", code)
    return [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("trainhist ")]


def _command(line: str) -> str:
    """A command line without its comment."""
    return line.split("  #")[0].strip()


def argv_of(line: str, cwd: Path) -> list[str]:
    """The words a shell would pass for LINE: split, comments dropped, unquoted-looking patterns expanded
    against the files of CWD (a pattern matching nothing stays as it is, as in a shell; a quoted pattern that
    matches nothing, like ``'encoder.*'``, therefore stays too)."""
    cmd = _command(line)
    for doc_cmd, substitute in SUBSTITUTIONS.items():
        if cmd == doc_cmd:
            cmd = substitute.format(python=shlex.quote(sys.executable))
    words = []
    for w in shlex.split(cmd, comments=True):
        hits = sorted(glob.glob(w, root_dir=cwd)) if any(c in w for c in "*?[") else []
        words += hits or [w]
    return words


def _given_gpt2(ns: dict) -> None:
    """What a training loop brings: the demo's tiny GPT-2, AdamW, a GradScaler, a warm-up schedule, three batches
    of 2 sequences of 16 tokens (``loader``), the first of them (``batch``) and a batch's token count."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=16,
                                       use_cache=False, bos_token_id=0, eos_token_id=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
    loader = [{"input_ids": x, "labels": x} for x in ids]
    ns.update(model=model, opt=opt, loader=loader, batch=loader[0], n_tokens=2 * 16,
              scaler=torch.amp.GradScaler("cpu"),
              sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)))


def _given_ranks(ns: dict) -> None:
    """``run.rank0.thist`` and ``run.rank1.thist``: two ranks of one run, as guide section 5 writes them."""
    import uuid

    import numpy as np

    import trainhist

    run = uuid.uuid4().hex
    for rank in range(2):
        with trainhist.HistoryWriter(f"run.rank{rank}.thist", run_id=run, rank=rank, world_size=2) as w:
            acts = w.site("encoder.0", "activation")
            weight = w.site("encoder.0.weight", "param", sharing="replica")
            for step in range(3):
                w.observe(acts, step, np.random.randn(64, 128).astype(np.float32))
                w.observe(weight, step, np.ones(16, np.float32))


GIVEN = {"gpt2": _given_gpt2, "ranks": _given_ranks}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # (a parent package missing, or a finder that refuses the name)
        return False


class DocRun:
    """One document's blocks, run in order in one namespace and one directory."""

    def __init__(self, doc: str, workdir: Path) -> None:
        self.blocks = parse(doc)
        self.dir = workdir
        self.ns: dict = {"__name__": f"doctest:{doc}"}
        self.done = 0
        self.failed: str | None = None

    def run_through(self, index: int) -> None:
        while self.done <= index:
            b = self.blocks[self.done]
            self.done += 1
            if self.failed:
                pytest.fail(f"{b.id} not run: {self.failed} failed")
            missing = [m for m in b.needs if not _importable(m)]
            if missing:
                if self.done - 1 == index:
                    pytest.skip(f"{b.id} needs {', '.join(missing)}")
                continue
            self.failed = b.id
            self._run(b)
            self.failed = None

    def _run(self, b: Block) -> None:
        old = os.getcwd()
        os.chdir(self.dir)
        try:
            for name in b.given:
                GIVEN[name](self.ns)
            for code in b.setup:
                exec(compile(code, f"{b.id} (setup)", "exec"), self.ns)
            if b.lang == "python":
                src = "\n" * b.line + _python_source(b.code)  # (tracebacks name the document's own lines)
                name = f"{ROOT / b.doc} (python block at line {b.line})"
                linecache.cache[name] = (len(src), None, src.splitlines(True), name)  # (and show them)
                exec(compile(src, name, "exec"), self.ns)
            else:
                for line in commands(b.code):
                    before = _mtimes(self.dir)
                    rc, out, err = run_cli(argv_of(line, self.dir))
                    assert rc == 0, f"{b.id}: `{line}` exited {rc}\n{out[-2000:]}\n{err[-2000:]}"
                    claim = CLAIMS.get((b.doc, _command(line)))
                    if claim:
                        claim(out, self.dir, before)
        finally:
            os.chdir(old)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``trainhist ARGV...`` in this process: exit status, stdout, stderr."""
    from trainhist.cli import main

    assert argv[0] == "trainhist", argv
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv[1:])
        except SystemExit as e:  # (argparse's usage errors)
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


_RUNS: dict[str, DocRun] = {}


@pytest.fixture(scope="module")
def doc_runs(tmp_path_factory):
    _RUNS.clear()
    yield lambda doc: _RUNS.setdefault(doc, DocRun(doc, tmp_path_factory.mktemp(Path(doc).stem)))
    _RUNS.clear()


ALL = [(doc, i, b) for doc in DOCS for i, b in enumerate(parse(doc))]


@pytest.mark.parametrize("doc,index,block", ALL, ids=[b.id for _, _, b in ALL])
def test_doc_block_runs(doc_runs, doc, index, block) -> None:
    doc_runs(doc).run_through(index)


def test_the_docs_have_the_blocks_this_test_runs() -> None:
    """The examples are found (a changed fence would silently test nothing), and every substitution still
    stands for a command of the docs."""
    blocks = {doc: parse(doc) for doc in DOCS}
    assert sum(b.lang == "python" for b in blocks["README.md"]) == 3
    assert sum(b.lang == "python" for b in blocks["docs/guide.md"]) == 10
    lines = {(doc, _command(c)) for doc, bs in blocks.items() for b in bs if b.lang == "sh" for c in commands(b.code)}
    for doc_cmd in SUBSTITUTIONS:
        assert any(c == doc_cmd for _, c in lines), doc_cmd
    for key in CLAIMS:
        assert key in lines, key


def test_guide_plot_site_writes_the_files_it_names(doc_runs) -> None:
    """Guide section 6 gives a `trainhist plot --site` command in its prose, with the names of the files it writes
    (`<path>.<stream>[.<facet>][.<phase>].site.png` and `.waterfall.png`): run on the history of the guide's torch
    example (the command's run.thist is "a file you were sent"; the guide's own run.thist has no such site)."""
    for m in ("torch", "transformers", "matplotlib"):
        pytest.importorskip(m)
    text = (ROOT / "docs/guide.md").read_text(encoding="utf-8")
    doc_cmd = "trainhist plot run.thist -o figs/ --site transformer.h.1.mlp.c_fc"
    assert f"`{doc_cmd}` writes `site_figure` and `waterfall`" in text.replace("\n", " ")
    assert "named `<path>.<stream>[.<facet>][.<phase>].site.png` and\n`.waterfall.png`" in text
    run = doc_runs("docs/guide.md")
    run.run_through(len(run.blocks) - 1)  # (train.thist: the guide's torch example)
    old = os.getcwd()
    os.chdir(run.dir)
    try:
        rc, out, err = run_cli(argv_of(doc_cmd.replace("run.thist", "train.thist"), run.dir))
    finally:
        os.chdir(old)
    assert rc == 0, err
    written = sorted(f.name for f in (run.dir / "figs").iterdir())
    assert written == [f"transformer.h.1.mlp.c_fc.{stream}.{kind}.png" for stream in ("activation", "activation_grad")
                       for kind in ("site", "waterfall")]
