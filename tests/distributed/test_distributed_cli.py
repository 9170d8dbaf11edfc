"""`pan2 decode --gpus N` and `torchrun -m pan2cli decode` on CPU processes (gloo): outputs, exit codes, one error line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pan2cli.distributed.protocol import EXIT_PEER_LOST
from pan2cli.errors import EXIT_INTERRUPTED
from tests.subprocess_env import hooked_env, python_env, wait_while_running

# Loaded by every process through PYTHONPATH: makes one rank fail (or hang) after its first chunk.
_FAILING_RANK = """
import os
if os.environ.get("RANK") == os.environ.get("PAN2_TEST_FAIL_RANK"):
    import pan2cli.vae.model as model
    real = model.WanVAEDecoder.decode_chunks

    def decode_chunks(self, *args, **kwargs):
        chunks = real(self, *args, **kwargs)
        yield next(chunks)
        if os.environ.get("PAN2_TEST_FAIL_KIND") == "hang":
            import time
            time.sleep(120)
        raise __import__("torch").OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.WanVAEDecoder.decode_chunks = decode_chunks
"""

# Loaded by every process through PYTHONPATH: each rank writes its pid to PIDS/rank<r>; after the first
# chunk the victim waits to be killed while the other rank goes on into a collective ("collective"),
# sleeps ("sleep": torchrun's SIGTERM ends it), or waits where no signal handler can run ("stuck",
# as a rank inside an NCCL wait does).
_RANK_TO_KILL = """
import os
if "RANK" in os.environ and os.environ.get("PAN2_TEST_PIDS"):
    with open(os.path.join(os.environ["PAN2_TEST_PIDS"], "rank" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    from pan2cli.vae.kernel.decoder import WanKernelDecoder
    from pan2cli.vae.model import WanVAEDecoder

    def stopping_after_the_first(real):
        def decode_uint8_chunks(self, *args, **kwargs):
            chunks = real(self, *args, **kwargs)
            yield next(chunks)
            if os.environ["RANK"] == os.environ["PAN2_TEST_VICTIM"]:
                __import__("time").sleep(120)
            elif os.environ["PAN2_TEST_SURVIVOR"] == "sleep":
                __import__("time").sleep(120)
            elif os.environ["PAN2_TEST_SURVIVOR"] == "stuck":
                __import__("torch").futures.Future().wait()  # a C++ wait that never returns
            yield from chunks

        return decode_uint8_chunks

    # Both decode paths: the reference (CPU) and the compiled kernel (the default on a GPU).
    for cls in (WanVAEDecoder, WanKernelDecoder):
        cls.decode_uint8_chunks = stopping_after_the_first(cls.decode_uint8_chunks)
"""


# Loaded by every rank through PYTHONPATH, after one of the hooks above: each rank also writes the exit
# code it chose itself (`record_exit`: its own error, a quiet exit after a peer's failure, or the end it
# gives itself after torchrun's SIGTERM) to PAN2_TEST_EXITS/exit<r>. A rank that torchrun had to SIGKILL
# (30 s after a SIGTERM it did not act on) never chose a code and leaves no file.
_RECORD_EXITS = """
import os
if "RANK" in os.environ and os.environ.get("PAN2_TEST_EXITS"):
    import pan2cli.distributed.lifecycle as lifecycle
    real_record_exit = lifecycle.record_exit

    def record_exit(code):
        with open(os.path.join(os.environ["PAN2_TEST_EXITS"], "exit" + os.environ["RANK"]), "w") as f:
            f.write(str(code))
        return real_record_exit(code)

    lifecycle.record_exit = record_exit
"""


# Loaded by every rank through PYTHONPATH: each rank writes its pid to PIDS/rank<r>; after their first chunk
# both ranks wait 120 s ("sleep", where a launcher killed then would leave them running), or rank 1 stops
# itself ("stop": SIGSTOP, hung and deaf to every signal but SIGKILL). PAN2_TEST_POLL_PARENT=1: no prctl,
# as where Linux's parent-death signal is not to be had.
_PAUSE_AFTER_THE_FIRST_CHUNK = """
import os, signal, time
if "RANK" in os.environ and os.environ.get("PAN2_TEST_PIDS"):
    if os.environ.get("PAN2_TEST_POLL_PARENT") == "1":
        import pan2cli.distributed.lifecycle
        pan2cli.distributed.lifecycle._signal_when_parent_dies = lambda: False
    with open(os.path.join(os.environ["PAN2_TEST_PIDS"], "rank" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))
    from pan2cli.vae.model import WanVAEDecoder
    real = WanVAEDecoder.decode_uint8_chunks

    def decode_uint8_chunks(self, *args, **kwargs):
        chunks = real(self, *args, **kwargs)
        yield next(chunks)
        if os.environ["PAN2_TEST_PAUSE"] == "sleep":
            time.sleep(120)
        elif os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        yield from chunks

    WanVAEDecoder.decode_uint8_chunks = decode_uint8_chunks
"""


def _chosen_exit(folder: Path, rank: str) -> str | None:
    """The exit code rank `rank` chose itself (`_RECORD_EXITS`), or None: it died or was SIGKILLed."""
    path = folder / f"exit{rank}"
    return path.read_text() if path.exists() else None


# Every rank: one thread (two ranks share the CI's two cores), and a short wait for a peer that is gone.
_RANK_VARIABLES = {"OMP_NUM_THREADS": "1", "PAN2_DIST_TIMEOUT": "60"}


def _env(tmp_path: Path, *first: Path, **extra: str) -> dict[str, str]:
    return python_env(*first, **{**_RANK_VARIABLES, **extra})


def _python(*args, env, cwd, **kwargs):
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
        **kwargs,
    )


def _decode_args(latents, vae, *extra, device: str = "cpu") -> list[str]:
    """`python -m pan2cli decode LATENTS --vae VAE --device DEVICE EXTRA...` without the interpreter."""
    return ["-m", "pan2cli", "decode", str(latents), "--vae", str(vae), "--device", device, *map(str, extra)]


def _hooked_env(tmp_path: Path, hook_code: str, **extra: str) -> tuple[Path, dict[str, str]]:
    """`_env` with a `sitecustomize.py` holding `hook_code` first on PYTHONPATH (every rank runs it); the hook
    folder is `tmp_path / "hook"`, where hooks may also leave files."""
    return tmp_path / "hook", hooked_env(tmp_path, hook_code, **{**_RANK_VARIABLES, **extra})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def _start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_until_writing(proc: subprocess.Popen, folder: Path, pids: Path) -> None:
    """Until both ranks left their pid in `pids` (`_PAUSE_AFTER_THE_FIRST_CHUNK`) and rank 0 writes out.mp4."""
    both_writing = lambda: (
        (pids / "rank0").exists()
        and (pids / "rank1").exists()
        and any(p.name.startswith(".out.mp4.partial") for p in folder.iterdir())
    )
    wait_while_running(proc, both_writing, time.monotonic() + 60)


def _end_ranks(pids: Path) -> None:
    """SIGKILL the ranks that left their pid in `pids`, if still there (a failed test leaves none behind)."""
    for path in pids.glob("rank[0-9]*"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(path.read_text()), signal.SIGKILL)


@pytest.fixture
def latents(latents_file):
    return latents_file((48, 3, 5, 3))  # 5 latent rows: 3/2 over 2 ranks


def test_gpus_on_cpu_writes_the_frames_of_one_process(tiny_vae, latents, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = _env(tmp_path, TMPDIR=str(tmp))
    one = _python(
        *_decode_args(latents, tiny_vae, "-o", "one.pt"),
        env=env,
        cwd=tmp_path,
    )
    assert one.returncode == 0, one.stderr
    two = _python(
        *_decode_args(latents, tiny_vae, "--gpus", "2", "-o", "two.pt"),
        env=env,
        cwd=tmp_path,
    )
    assert two.returncode == 0, two.stderr
    assert two.stdout.strip() == "two.pt"  # rank 0 alone prints the path and the summary
    assert list(tmp.iterdir()) == []  # no torchelastic_* (torchrun's run folder) or pan2-ranks-*
    assert two.stderr.count("9 frames, 80x48") == 1
    a = torch.load(tmp_path / "one.pt", weights_only=True)
    b = torch.load(tmp_path / "two.pt", weights_only=True)
    assert a.shape == b.shape == (9, 80, 48, 3)
    # fp32 sums in another order may move a pixel across a rounding boundary: at most 1 level
    assert (a.int() - b.int()).abs().max().item() <= 1

    # 3. The same command under a user's own torchrun.
    direct = _python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        *_decode_args(latents, tiny_vae, "-o", "three.pt"),
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert direct.returncode == 0, direct.stderr
    assert torch.equal(torch.load(tmp_path / "three.pt", weights_only=True), b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latents.pt", "one.pt", "three.pt", "tmp", "two.pt"]


def test_more_gpus_than_visible_is_bad_input(run_cli, tiny_vae, latents):
    if torch.cuda.is_available() and torch.cuda.device_count() >= 3:
        pytest.skip("this machine has 3 GPUs")
    result = run_cli("decode", latents, "--vae", tiny_vae, "--gpus", 3)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: --gpus 3: only")


@pytest.mark.parametrize("kind", ["bad_latents", "too_few_rows"])
def test_bad_input_under_gpus_exits_2_with_one_error_line(tiny_vae, tmp_path, kind):
    path = tmp_path / "bad.pt"
    if kind == "bad_latents":
        path.write_text("not a tensor\n")
    else:
        torch.save(
            torch.randn(48, 2, 1, 3, generator=torch.Generator().manual_seed(0)), path
        )  # one latent row for two ranks
    proc = _python(
        *_decode_args(path, tiny_vae, "--gpus", "2", "-o", "out.pt"),
        env=_env(tmp_path),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert len(_error_lines(proc.stderr)) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


def test_an_error_every_rank_hits_after_the_launch_is_printed_once(tiny_vae, latents, tmp_path):
    """The launcher checks the inputs it can (`--gpus`, the row split); an output that exists is found by the ranks
    themselves, each the same error: rank 0 prints it, once (no rank printing it left exit 2 and not a word)."""
    (tmp_path / "out.pt").write_bytes(b"mine")
    proc = _python(
        *_decode_args(latents, tiny_vae, "--gpus", "2", "-o", "out.pt"), env=_env(tmp_path), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert _error_lines(proc.stderr) == ["Error: output out.pt already exists"], proc.stderr
    assert "Hint: pass --overwrite to replace it" in proc.stderr and proc.stdout == ""
    assert (tmp_path / "out.pt").read_bytes() == b"mine"


@pytest.mark.parametrize("failing_rank", ["0", "1"])
def test_one_rank_failing_stops_all_with_its_code(tiny_vae, latents, tmp_path, failing_rank):
    """One rank's error stops every rank at once, with that rank's code and error line.

    No clock (docs/TESTING.md): "at once" is checked by what ended the ranks. The collective timeout is set
    beyond the 120 s hang guard of `_python` (ranks the guard leaves behind still end 30 s later), so a
    run that needed it to end fails as a hang; and the healthy rank must have chosen its own exit code (a
    quiet exit after its peer's failure, or the end it gives itself on torchrun's SIGTERM), which a rank
    that torchrun SIGKILLs 30 s after its SIGTERM never does."""
    hook, env = _hooked_env(
        tmp_path,
        _FAILING_RANK + _RECORD_EXITS,
        PAN2_TEST_FAIL_RANK=failing_rank,
        PAN2_TEST_EXITS=str(tmp_path / "hook"),
        PAN2_DIST_TIMEOUT="150",
    )
    proc = _python(
        *_decode_args(latents, tiny_vae, "--gpus", "2", "-o", "out.mp4"),
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    assert _error_lines(proc.stderr) == [
        "Error: the GPU ran out of memory while decoding (1, 48, 3, 5, 3) latents with 4 latent frames "
        "per chunk: CUDA out of memory. Tried to allocate 2.00 GiB"
    ], proc.stderr
    healthy = "1" if failing_rank == "0" else "0"
    assert _chosen_exit(hook, failing_rank) == "1"
    assert _chosen_exit(hook, healthy) in (str(EXIT_INTERRUPTED), str(EXIT_PEER_LOST)), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "latents.pt"]  # no partial output


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize(
    "signum, code, line",
    [(signal.SIGINT, 130, "Interrupted."), (signal.SIGTERM, 143, "Terminated.")],
    ids=["ctrl-c", "sigterm"],
)
def test_ctrl_c_stops_every_rank_and_removes_the_partial_output(
    tiny_vae, latents, tmp_path, signum, code, line
):
    _, env = _hooked_env(tmp_path, _FAILING_RANK, PAN2_TEST_FAIL_RANK="1", PAN2_TEST_FAIL_KIND="hang")
    cmd = [sys.executable, *_decode_args(latents, tiny_vae, "--gpus", "2", "-o", "out.mp4")]
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    writing = lambda: any(p.name.startswith(".out.mp4.partial") for p in tmp_path.iterdir())  # rank 0 writes
    wait_while_running(proc, writing, time.monotonic() + 60)
    proc.send_signal(signum)  # SIGINT: the terminal's Ctrl-C; SIGTERM: `kill`, a job scheduler
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert err.count(line) == 1 and not _error_lines(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "latents.pt"]


_TWO_CUDA_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _TWO_CUDA_GPUS])],
    ids=["gloo", "nccl"],
)  # NCCL: the survivor waits inside NCCL, where no Python signal handler runs
@pytest.mark.parametrize("victim, survivor", [("0", "collective"), ("1", "sleep"), ("0", "stuck")])
def test_a_rank_killed_stops_all_and_is_named(tiny_vae, latents_file, tmp_path, victim, survivor, device):
    """A rank killed outright is named, and the other rank ends itself, also where it waits beyond the reach
    of signal handlers ("stuck", as inside NCCL).

    No clock (docs/TESTING.md): the survivor must have ended before torchrun's SIGKILL, 30 s after its SIGTERM.
    Observed without timing: the survivor chose its own exit code (`_RECORD_EXITS`), which a rank that
    torchrun has to SIGKILL never does; `communicate`'s timeout only guards against a hang."""
    hook, env = _hooked_env(
        tmp_path,
        _RANK_TO_KILL + _RECORD_EXITS,
        PAN2_TEST_PIDS=str(tmp_path / "hook"),
        PAN2_TEST_EXITS=str(tmp_path / "hook"),
        PAN2_TEST_VICTIM=victim,
        PAN2_TEST_SURVIVOR=survivor,
    )
    latents = latents_file(
        (48, 3, 4, 3), seed=1
    )  # 2 latent rows per rank; 2 chunks with --chunk-latent-frames 2
    cmd = [
        sys.executable,
        *_decode_args(
            latents, tiny_vae, "--gpus", 2, "--chunk-latent-frames", 2, "-o", "out.mp4", device=device
        ),
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pid_file = hook / f"rank{victim}"
        ready = lambda: (
            pid_file.exists() and any(p.name.startswith(".out.mp4.partial") for p in tmp_path.iterdir())
        )
        wait_while_running(proc, ready, time.monotonic() + 60)
        time.sleep(0.5)  # the other rank reaches its next collective (or its sleep, or its stuck wait)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert _error_lines(err) == [f"Error: rank {victim} was killed by signal 9 (SIGKILL)"], err
    assert "Interrupted." not in err and "Terminated." not in err and "Traceback" not in err
    other = "1" if victim == "0" else "0"
    assert _chosen_exit(hook, victim) is None
    # torchrun's SIGTERM (130), or its collective failing on the dead peer (EXIT_PEER_LOST)
    assert _chosen_exit(hook, other) in (str(EXIT_INTERRUPTED), str(EXIT_PEER_LOST)), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "latents.pt"]  # no partial output


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("poll", ["0", "1"], ids=["parent-death-signal", "polling-the-parent"])
def test_a_launcher_killed_outright_takes_its_ranks_with_it(tiny_vae, latents, tmp_path, poll):
    """`kill -9` of `pan2 ... --gpus 2` (a scheduler's job kill) ends its ranks at once, with no
    output written after it died, no partial file, and nothing left in TMPDIR (pan2's folder of the ranks,
    torchrun's run folder); by Linux's parent-death signal, or by the thread that polls the parent's pid.

    No clock (docs/TESTING.md): the ranks wait 120 s after their first chunk, and `communicate` returns once every
    process holding the launcher's stderr has ended, the ranks included (they inherit it); its 60 s timeout
    only guards against a hang."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    hook, env = _hooked_env(
        tmp_path,
        _PAUSE_AFTER_THE_FIRST_CHUNK,
        PAN2_TEST_PIDS=str(tmp_path / "hook"),
        PAN2_TEST_PAUSE="sleep",
        PAN2_TEST_POLL_PARENT=poll,
        TMPDIR=str(tmp),
    )
    proc = _start(_decode_args(latents, tiny_vae, "--gpus", 2, "-o", "out.mp4"), env, tmp_path)
    try:
        _wait_until_writing(proc, tmp_path, hook)
        proc.kill()  # SIGKILL, to the launcher alone: the ranks run in sessions of their own
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        _end_ranks(hook)
    assert "Traceback" not in err and not _error_lines(err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "latents.pt", "tmp"]
    assert list(tmp.iterdir()) == []


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_a_hung_rank_is_named_as_hung_after_the_timeout(tiny_vae, latents, tmp_path):
    """A rank that stops answering (SIGSTOP) is named as hung once its peer waited
    PAN2_DIST_TIMEOUT, not as killed by the SIGKILL that ends it; no output or temporary file is left.

    No clock (docs/TESTING.md): torchrun alone would SIGKILL the stopped rank 30 s after its SIGTERM, and pan2 then
    reported "rank 1 was killed by signal 9 (SIGKILL)"; the line says which of the two ended it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    hook, env = _hooked_env(
        tmp_path,
        _PAUSE_AFTER_THE_FIRST_CHUNK,
        PAN2_TEST_PIDS=str(tmp_path / "hook"),
        PAN2_TEST_PAUSE="stop",
        PAN2_DIST_TIMEOUT="6",
        TMPDIR=str(tmp),
    )
    proc = _start(_decode_args(latents, tiny_vae, "--gpus", 2, "-o", "out.mp4"), env, tmp_path)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        _end_ranks(hook)
    assert proc.returncode == 1, err
    assert _error_lines(err) == [
        "Error: rank 1 hung: rank 0 waited PAN2_DIST_TIMEOUT=6 s for it, and pan2 ended it"
    ], err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "latents.pt", "tmp"]
    assert list(tmp.iterdir()) == []
