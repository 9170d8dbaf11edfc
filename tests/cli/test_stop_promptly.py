"""A long run that can be followed and stopped: without a terminal each step says in a line that it started, and
Ctrl-C or SIGTERM ends the command within seconds even while its main thread is inside one long torch op (which
holds Python's signal handlers back: SIGINT took 26-38 s to act), its temporary output removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.subprocess_env import hooked_env, wait_while_running

CLI_SMALL = ("--steps", 1, "--frames", 9, "--size", "64x64", "--device", "cpu")

# Loaded by the `pan2 generate` process through PYTHONPATH: after the decode's first chunk, its main thread waits
# in C++ (as inside one long torch op) and never returns to Python; a file says when.
_STUCK_IN_THE_DECODE = """
import os
if os.environ.get("PAN2_TEST_MARK"):
    from pan2cli.vae.model import WanVAEDecoder
    real = WanVAEDecoder.decode_uint8_chunks

    def decode_uint8_chunks(self, *args, **kwargs):
        chunks = real(self, *args, **kwargs)
        yield next(chunks)
        open(os.environ["PAN2_TEST_MARK"], "w").close()
        __import__("torch").futures.Future().wait()  # a C++ wait that never returns
        yield from chunks

    WanVAEDecoder.decode_uint8_chunks = decode_uint8_chunks
"""


def test_without_a_terminal_each_step_says_it_started(tiny_pan2, run_cli, tmp_path):
    """The progress bar is off when stderr is not a terminal (CliRunner's is not): a line per step instead."""
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", tmp_path / "cat.mp4")
    assert res.exit_code == 0, res.stderr
    lines = res.stderr.splitlines()
    for started in ("Encoding the prompts: 1 prompts…", "Denoising (1 steps)…", "Decoding: 9 frames…"):
        assert started in lines, res.stderr
    assert lines.index("Denoising (1 steps)…") < lines.index("Decoding: 9 frames…")
    quiet = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-q", "-o", tmp_path / "q.mp4")
    assert quiet.exit_code == 0 and quiet.stderr == ""


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize(
    "signum, code, line",
    [(signal.SIGINT, 130, "Interrupted."), (signal.SIGTERM, 143, "Terminated.")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_signal_ends_the_command_within_seconds_inside_a_long_op(tiny_pan2, tmp_path, signum, code, line):
    mark, out = tmp_path / "stuck", tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable,
        "-m",
        "pan2cli",
        "generate",
        "a cat",
        "--model",
        str(tiny_pan2),
        *map(str, CLI_SMALL),
    ]
    env = hooked_env(tmp_path, _STUCK_IN_THE_DECODE, PAN2_TEST_MARK=str(mark))
    proc = subprocess.Popen(
        [*command, "-o", str(out / "cat.mp4")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        wait_while_running(proc, mark.exists, deadline)
        partial = (
            out / f".cat.mp4.partial-{proc.pid}.mp4"
        )  # being written: ffmpeg opens it once it has a frame
        wait_while_running(proc, partial.exists, deadline)
        assert [p.name for p in out.iterdir()] == [partial.name]
        proc.send_signal(signum)
        # The main thread never comes back: only the watcher can end the process (a hang guard, not a timing).
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert stderr.splitlines()[-1] == line and stdout == ""
    assert list(out.iterdir()) == []  # the temporary MP4 removed
