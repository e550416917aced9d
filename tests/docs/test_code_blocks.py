"""Every fenced code block of README.md, BENCHMARKS.md and docs/ is run here, or says why it is not, so the
quick starts and the guide's examples cannot rot.

The rules a page follows (docs/development.md repeats them for writers):

- A block right below an HTML comment ``<!-- not-run: REASON -->`` is not run, and REASON must say why (it
  starts a server, installs from PyPI, needs a framework's own classes or several processes...).
- ``text`` and ``mermaid`` blocks are data (formulas, drawings, a bench's output): never run.
- ``python`` blocks run in page order in one namespace per page, as a reader pasting them one after another
  would. ``/models/llama`` is the tests' tiny Llama and each ``/adapters/NAME`` or ``/ckpt/NAME`` a tiny PEFT
  adapter over it, made for the page (rank 4 on attention, but ``chat`` rank 8 and ``law`` rank 32, as a
  deployment's later adapters may be larger than its start-up ones); nothing else is provided.
- ``bash`` blocks run command by command (continuation lines joined), and every command must be a
  ``lora-pin`` command: it runs as ``python -m lora_pin``, a generated workload cut to 20,000 requests (the
  figures change, the options and the shape of the output do not), a ``--trace FILE`` given a small trace.
  Anything else in a bash block fails here: mark such a block not-run with the reason.
- Any other fence language fails: use one of these, or mark the block.

Not run, by their markers: the blocks that start servers (``lora-pin serve``, a Ray cluster, a metrics port)
or talk to one (curl, the openai client), since tests/serve/ and tests/model/test_metrics.py start the same
servers on a tiny model and check their answers; ``pip install``s (network); the two commands (they are the
whole job and the whole suite); examples that need a framework's own classes or several ranks (tests/parallel/
runs lora_pin.parallel_fixtures' layers instead); the long reliability runs.

README's quick start is also checked against PEFT (its logits equal PEFT's mixed-batch forward).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p.relative_to(ROOT)),
)
RUN = {"python", "bash"}
DATA = {"text", "mermaid"}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: Ranks of the adapters a page names, where not the default 4.
RANKS = {"chat": 8, "law": 32}
MAX_REQUESTS = 20_000

FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`\n]*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:(?P<reason>.*?)-->\s*$", re.S)
PATH = re.compile(r"/(?:adapters|ckpt)/(?P<name>[A-Za-z0-9_][A-Za-z0-9_.-]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    not_run: str | None  # the reason given, when the block is marked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, each with the not-run reason written right above it."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n")
        marker = NOT_RUN.search(before[before.rfind("<!--") :]) if before.endswith("-->") else None
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                lang=match["info"].strip().split(" ")[0],
                code=match["code"],
                not_run=None if marker is None else marker["reason"].strip(),
            )
        )
    return found


def runnable(lang: str) -> list[Path]:
    return [p for p in PAGES if any(b.lang == lang and b.not_run is None for b in blocks(p))]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_pages_have_runnable_blocks() -> None:
    """The parser finds the quick starts: a broken fence pattern would otherwise pass every test below."""
    readme = blocks(ROOT / "README.md")
    assert [b.lang for b in readme if b.not_run is None] == ["python", "python", "bash"]
    assert ROOT / "docs" / "engine.md" in runnable("python")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_run_or_says_why_not(page: Path) -> None:
    for block in blocks(page):
        if block.not_run is not None:
            assert len(block.not_run) >= 10, f"{block.where}: say why the block is not run"
        else:
            assert block.lang in RUN | DATA, (
                f"{block.where}: a ```{block.lang or '(no language)'} block: use python, bash, text or "
                "mermaid, or mark it <!-- not-run: REASON -->"
            )


class Fixtures:
    """The paths a page names, made on first use: the tiny Llama and tiny PEFT adapters over it."""

    def __init__(self, model_dir: Path, make_adapters: Any, root: Path) -> None:
        self.model_dir, self.make_adapters, self.root = model_dir, make_adapters, root
        self.made: dict[str, Path] = {}

    def adapter(self, name: str) -> Path:
        if name not in self.made:
            seed = zlib.crc32(name.encode())
            spec = dict(r=RANKS.get(name, 4), lora_alpha=8, target_modules=ATTN, seed=seed)
            self.made.update(self.make_adapters(self.root, {name: spec}))
        return self.made[name]

    def localise(self, code: str) -> str:
        code = code.replace("/models/llama", str(self.model_dir))
        code = PATH.sub(lambda m: str(self.adapter(m["name"])), code)
        assert "/adapters/" not in code and "/models/" not in code and "/ckpt/" not in code, code
        return code


def run_python(page: Path, fixtures: Fixtures) -> dict[str, Any]:
    """Runs ``page``'s runnable python blocks in order in one namespace; returns it."""
    namespace: dict[str, Any] = {"__name__": f"docs:{page_id(page)}"}
    for block in blocks(page):
        if block.lang == "python" and block.not_run is None:
            exec(compile(fixtures.localise(block.code), block.where, "exec"), namespace)
    return namespace


@pytest.mark.parametrize("page", runnable("python"), ids=page_id)
def test_python_blocks_run(page: Path, tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path) -> None:
    run_python(page, Fixtures(tiny_llama_dir, make_adapters, tmp_path))


def commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    split = (shlex.split(line, comments=True) for line in joined.splitlines())
    return [argv for argv in split if argv]


def cut_down(argv: list[str], cwd: Path) -> list[str]:
    """``lora-pin ...`` as this test runs it: see the module docstring."""
    assert argv[0] == "lora-pin", f"only lora-pin commands run in docs' bash blocks: {shlex.join(argv)}"
    argv = [sys.executable, "-m", "lora_pin", *argv[1:]]
    if "--requests" in argv:
        at = argv.index("--requests") + 1
        argv[at] = str(min(int(argv[at]), MAX_REQUESTS))
    elif "--workload" in argv:
        argv += ["--requests", str(MAX_REQUESTS)]
    if "--trace" in argv:
        trace = cwd / argv[argv.index("--trace") + 1]
        adapters = (None if i % 5 == 0 else f"a{i % 7}" for i in range(500))
        lines = (json.dumps({"adapter": adapter, "tokens": 1}) for adapter in adapters)
        trace.write_text("\n".join(lines) + "\n")
    return argv


@pytest.mark.parametrize("page", runnable("bash"), ids=page_id)
def test_bash_blocks_run(page: Path, tmp_path: Path) -> None:
    for block in blocks(page):
        if block.lang != "bash" or block.not_run is not None:
            continue
        for argv in commands(block.code):
            command = cut_down(argv, tmp_path)
            run = subprocess.run(
                command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
            )
            assert run.returncode == 0, f"{block.where}: {shlex.join(argv)}\n{run.stdout}\n{run.stderr}"
            assert run.stdout.strip(), f"{block.where}: {shlex.join(argv)} printed nothing"


def test_the_readme_quick_start_matches_peft(
    tiny_llama_dir: Path, make_adapters: Any, tmp_path: Path
) -> None:
    """README's quick start as written: its logits equal PEFT's mixed batch, and "law", loaded at run time
    with a larger rank than the start-up adapters, is gone after its unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fixtures = Fixtures(tiny_llama_dir, make_adapters, tmp_path)
    namespace = run_python(ROOT / "README.md", fixtures)

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    oracle = PeftModel.from_pretrained(base, str(fixtures.adapter("math")), adapter_name="math")
    oracle.load_adapter(str(fixtures.adapter("chat")), adapter_name="chat")
    with torch.no_grad():
        want = oracle(namespace["input_ids"], adapter_names=["math", "__base__", "chat"]).logits
    torch.testing.assert_close(namespace["logits"], want, rtol=1e-4, atol=1e-5)
    assert "law" not in namespace["mgr"].stats()["host"]["resident"]
    assert set(namespace["step"].admitted) | set(namespace["step"].deferred) == {0, 1, 2, 3}


@pytest.mark.parametrize("what", ["position_ids", "KV cache"])
def test_the_step_loop_says_what_an_hf_model_needs(what: str) -> None:
    """Packing requests into one row silently mixes their attention unless the engine does both."""
    engine = (ROOT / "docs" / "engine.md").read_text()
    section = engine[engine.index("## The step loop") : engine.index("## An engine that schedules after")]
    assert what in section
    readme = (ROOT / "README.md").read_text()
    assert what.split()[0] in readme[readme.index("## Quick start 1") : readme.index("## Quick start 2")]
