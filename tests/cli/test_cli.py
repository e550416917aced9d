"""The ``lora-pin`` command as a process: start-up without torch, missing extras, Ctrl-C, closed pipes,
progress only on terminals, and help text on every option."""

from __future__ import annotations

import argparse
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lora_pin._core import Trace, simulate
from lora_pin.cli import build_parser

# Replays long enough to interrupt (about 6 s on one core) and to draw a bar (about 3 s; tqdm waits 1 s).
LONG_SIMULATE = ["simulate", "--requests", "3000000", "--slots", "8,16", "--policy", "lru,fifo"]
BAR_SIMULATE = ["simulate", "--requests", "3000000", "--slots", "8", "--policy", "lru,fifo", "--json"]


def python_cli(*argv: str, block: tuple[str, ...] = (), after: str = "") -> list[str]:
    """A command running ``lora_pin.cli.main(argv)`` with the modules in ``block`` made unimportable;
    ``after`` runs once main returned (its status is in ``status``)."""
    script = "\n".join(
        [
            "import sys",
            *(f"sys.modules[{m!r}] = None" for m in block),
            "from lora_pin.cli import main",
            "try:",
            f"    status = main({list(argv)!r})",
            "except SystemExit as e:",
            "    status = e.code",
            after,
            "sys.exit(status)",
        ]
    )
    return [sys.executable, "-c", script]


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


REPORT_HEAVY = (
    "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules), file=sys.stderr)"
)


@pytest.mark.parametrize(
    "argv",
    [
        ["parse", "--lora-paths", "a=/x", "b=/y"],
        ["--help"],
        ["--version"],
        ["parse", "--help"],
        ["simulate", "--requests", "100", "--slots", "4"],
    ],
)
def test_light_commands_never_import_torch(argv: list[str]) -> None:
    out = run(python_cli(*argv, after=REPORT_HEAVY))
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]"


def test_parse_runs_where_torch_cannot_be_imported() -> None:
    out = run(python_cli("parse", "--lora-paths", "a=/x", block=("torch",)))
    assert out.returncode == 0, out.stderr
    assert '"lora_name": "a"' in out.stdout


@pytest.mark.parametrize(
    ("argv", "block", "missing", "extra"),
    [
        (["demo", "--requests", "1"], ("transformers",), "transformers", "hf"),
        (["demo", "--requests", "1"], ("peft",), "peft", "hf"),
    ],
)
def test_a_command_missing_an_extra_names_it(
    argv: list[str], block: tuple[str, ...], missing: str, extra: str, tmp_path: Path
) -> None:
    out = run(python_cli(*argv, "--cache-dir", str(tmp_path), block=block))
    assert out.returncode == 1, out.stderr
    assert f"needs {missing}" in out.stderr and f"pip install 'lora_pin[{extra}]'" in out.stderr
    assert "Traceback" not in out.stderr
    assert not any(tmp_path.iterdir()), "nothing is generated before the missing extra is reported"


def test_inspect_with_a_model_names_the_hf_extra(
    tmp_path: Path, tiny_llama_dir: Path, make_adapters: Callable[..., dict[str, Path]]
) -> None:
    adapter = make_adapters(tmp_path, {"a": dict(r=2, lora_alpha=4, target_modules=["q_proj"])})["a"]
    plain = run(python_cli("inspect", str(adapter), block=("transformers", "peft")))
    assert plain.returncode == 0, plain.stderr
    out = run(python_cli("inspect", str(adapter), "--model", str(tiny_llama_dir), block=("transformers",)))
    assert out.returncode == 1, out.stderr
    assert "pip install 'lora_pin[hf]'" in out.stderr and "Traceback" not in out.stderr


def read_terminal_until(fd: int, proc: subprocess.Popen[bytes], marker: bytes) -> bytes:
    """What the child wrote to the terminal ``fd`` until ``marker`` appeared (it must appear: a hang
    guard of minutes, far past any start-up, ends the wait otherwise)."""
    seen = b""
    deadline = time.monotonic() + 300
    while marker not in seen:
        assert time.monotonic() < deadline and proc.poll() is None, seen[-400:]
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            seen += os.read(fd, 4096)
    return seen


def test_ctrl_c_stops_a_long_simulate_quietly_with_130() -> None:
    """Ctrl-C while a replay runs (its progress bar is on the terminal: start-up is over and the sweep
    under way; Ctrl-C used to wait there for the whole Rust call to return) stops the sweep part way:
    status 130, no table, no traceback."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_pin", *LONG_SIMULATE], stdout=subprocess.PIPE, stderr=secondary
    )
    os.close(secondary)
    try:
        seen = read_terminal_until(primary, proc, b"simulate:")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
        seen += read_terminal(primary, proc)
    finally:
        os.close(primary)
    assert proc.returncode == 130, seen[-400:]
    # The sweep prints its table when it ends: none, so Ctrl-C stopped it part way.
    assert out == b""
    assert b"Traceback" not in seen and b"KeyboardInterrupt" not in seen, seen[-400:]


@pytest.mark.parametrize(
    "argv",
    [
        ["parse", "--lora-paths", *(f"a{i}=/adapters/a{i}" for i in range(50))],
        ["--help"],
        ["simulate", "--requests", "1000", "--slots", "4"],
    ],
)
def test_a_pipe_closed_early_exits_quietly(argv: list[str]) -> None:
    # `lora-pin parse ... | head -c0`: the reader is gone before the command writes.
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_pin", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 141), err
    assert err == b""


def test_simulate_progress_calls_back_and_keeps_the_results() -> None:
    trace = Trace.generate("zipf:1.0", adapters=64, requests=1_000_000, seed=3)
    calls: list[int] = []
    with_progress = simulate(trace, slots=8, policy="lru", progress=calls.append)
    assert with_progress == simulate(trace, slots=8, policy="lru")
    assert calls[-1] == len(trace) and calls == sorted(calls)
    assert len(calls) >= 2, "a replay of about a second reports before its end"


def test_an_exception_in_the_progress_callback_stops_the_replay() -> None:
    trace = Trace.generate("zipf:1.0", adapters=64, requests=1_000_000, seed=3)
    calls: list[int] = []

    def stop(served: int) -> None:
        calls.append(served)
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        simulate(trace, slots=8, policy="lru", progress=stop)
    assert calls[0] < len(trace), "the callback stopped the replay part way"


def read_terminal(fd: int, proc: subprocess.Popen[bytes]) -> bytes:
    seen = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                return seen
            seen += chunk
        elif proc.poll() is not None:
            return seen


def test_simulate_shows_progress_on_a_terminal_only() -> None:
    primary, secondary = pty.openpty()
    # A terminal 100 columns wide (a new pty has none, and tqdm draws nothing in 0 columns).
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "lora_pin", *BAR_SIMULATE],
        stdout=subprocess.DEVNULL,
        stderr=secondary,
    )
    os.close(secondary)
    try:
        seen = read_terminal(primary, proc)
    finally:
        os.close(primary)
    assert proc.wait(timeout=120) == 0
    assert b"simulate:" in seen and b"req" in seen, seen[-400:]
    # The same long run into a pipe or a log: no bar.
    piped = run([sys.executable, "-m", "lora_pin", *BAR_SIMULATE])
    assert piped.returncode == 0 and piped.stderr == ""


def test_the_demo_writes_no_progress_bar_into_logs(tmp_path: Path) -> None:
    out = run(
        [sys.executable, "-m", "lora_pin", "demo", "--cache-dir", str(tmp_path), "--requests", "40"],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "lora-pin demo:" in out.stdout and out.stderr == ""


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    found = [("lora-pin", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(f"lora-pin {name}", sub) for name, sub in action.choices.items()]
    return found


def test_every_option_of_every_command_has_help_text() -> None:
    missing = [
        f"{prog} {'/'.join(a.option_strings) or a.dest}"
        for prog, parser in parsers()
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()
    ]
    assert len(parsers()) == 7
    assert missing == []
