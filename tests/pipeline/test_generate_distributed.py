"""`pan2 generate` over several processes on CPU (gloo): a prompt file sharded over two "nodes", one prompt over --gpus 2."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Iterator

import pytest

from tests.subprocess_env import python_env

SMALL = ["--steps", "1", "--frames", "5", "--size", "64x96", "--device", "cpu"]


def _env(**extra: str) -> dict[str, str]:
    return python_env(**{"OMP_NUM_THREADS": "1", "PAN2_DIST_TIMEOUT": "60", **extra})


@pytest.fixture
def rendezvous_port() -> Iterator[int]:
    """The port of a TCP store that this process hosts for the nodes' c10d rendezvous, which both nodes join
    as clients (`is_host=0`); it listens from the moment the OS chose the port until the test ends.

    Not a port found free beforehand: one found by binding and closing a socket could be taken by another
    process before node 0 bound it again. Each node's agent serves its workers from a port of its own, which
    torchrun also has the OS choose at bind time (its shared TCPStore)."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def test_prompt_file_sharded_over_two_nodes(tiny_pan2, tmp_path, rendezvous_port):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["a cat", "a dog", "the fox", "a red door"]))
    out = tmp_path / "videos"
    out.mkdir()
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"localhost:{rendezvous_port}",
                "--rdzv-conf",
                "is_host=0",
                "--rdzv-id",
                "pan2test",
                "--log-dir",  # torchrun's run folder, else a /tmp/torchelastic_* left behind
                str(tmp_path / f"torchrun{rank}"),
                "-m",
                "pan2cli",
                "generate",
                "--prompts",
                str(prompts),
                "--model",
                str(tiny_pan2),
                *SMALL,
                "-o",
                str(out),
            ],
            env=_env(),
            cwd=tmp_path,
            stdout=(tmp_path / f"out{rank}").open("w"),
            stderr=(tmp_path / f"err{rank}").open("w"),
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        for node in nodes:  # files, not pipes: a full pipe would stall one node and, at the barrier, both
            node.wait(timeout=120)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    outputs = [((tmp_path / f"out{r}").read_text(), (tmp_path / f"err{r}").read_text()) for r in (0, 1)]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr
    # global rank r takes prompts r and r + 2 (c10d assigns the ranks, not --node-rank): each node two
    written = sorted(sorted(stdout.split()) for stdout, _ in outputs)
    assert written == [
        [str(out / "000_a-cat.mp4"), str(out / "002_the-fox.mp4")],
        [str(out / "001_a-dog.mp4"), str(out / "003_a-red-door.mp4")],
    ]
    assert len(list(out.glob("*.mp4"))) == 4 and len(list(out.glob("*.json"))) == 4
    assert sum("4 video(s) written, 0 skipped, 0 failed." in stderr for _, stderr in outputs) == 1
    # each rank streams its own share: its first video is written before its second is denoised
    for stdout, stderr in outputs:
        first = stdout.split()[0]
        lines = stderr.splitlines()
        written_at = next(i for i, line in enumerate(lines) if line.startswith(f"{first}: "))
        denoising = [i for i, line in enumerate(lines) if line.startswith("Denoising")]
        assert len(denoising) == 2 and denoising[0] < written_at < denoising[1], stderr


def test_one_prompt_on_two_processes_matches_one(tiny_pan2, tmp_path):
    """One prompt under `--gpus 2` on the CPU (gloo): the latents and the decoded video of one process (the two
    ranks sample the same latents, then split the decode by rows; rank 0 writes)."""
    # Lossless H.264 (--crf 0): the frames are compared, not how x264 spends its bits on a level of difference.
    common = [
        "-m",
        "pan2cli",
        "generate",
        "a cat",
        "--model",
        str(tiny_pan2),
        *SMALL,
        "--save-latents",
        "--crf",
        "0",
    ]
    one = subprocess.run(
        [sys.executable, *common, "-o", "one.mp4"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr
    two = subprocess.run(
        [sys.executable, *common, "-o", "two.mp4", "--gpus", "2"],
        env=_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert two.returncode == 0, two.stderr
    assert two.stdout.strip() == "two.mp4"  # rank 0 alone writes and prints
    for run in (
        one,
        two,
    ):  # on the CPU the reference decoder is the only path: nothing to say about the kernel
        assert "compiled kernel" not in run.stderr and "another rank" not in run.stderr, run.stderr
    import torch

    a = torch.load(tmp_path / "one.latents.pt", weights_only=True)["latents"]
    b = torch.load(tmp_path / "two.latents.pt", weights_only=True)["latents"]
    assert torch.equal(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "one.json",
        "one.latents.pt",
        "one.mp4",
        "two.json",
        "two.latents.pt",
        "two.mp4",
    ]
    # The decoded videos, not only the latents: on the CPU the two ranks split the decode by rows (each 3x3 conv
    # reads a halo row from its neighbour), and rank 0 writes the gathered frames. Measured: bit-identical MP4s
    # (fp32 on the CPU). The split's fp32 sums may run in another order than the whole frame's (one uint8 level
    # at most, tests/distributed/test_distributed_cli.py), which x264 may spread a little; the bound leaves that room. A
    # halo row taken from the wrong side gives 35 levels on average, up to 200 (measured).
    import imageio_ffmpeg
    import numpy as np

    def mp4_frames(name: str) -> torch.Tensor:
        reader = imageio_ffmpeg.read_frames(str(tmp_path / name))
        width, height = next(reader)["size"]
        return torch.from_numpy(
            np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])
        ).int()

    frames_one, frames_two = mp4_frames("one.mp4"), mp4_frames("two.mp4")
    assert frames_one.shape == frames_two.shape == (5, 64, 96, 3)
    difference = (frames_one - frames_two).abs()
    assert difference.float().mean().item() <= 0.1 and difference.max().item() <= 8, (
        difference.float().mean().item(),
        difference.max().item(),
    )


def test_chains_go_whole_to_the_processes(tiny_pan2, tmp_path):
    """`--gpus 2` with a file of two chains: each chain's rounds on one process, one after another; the two chains
    side by side, each with its stitched video."""
    prompts = tmp_path / "world.txt"
    prompts.write_text("a knight\n+ a torch\nb boat\n+ a storm\n+ a wreck\n")
    out = tmp_path / "videos"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "pan2cli", "generate", "--prompts", str(prompts), "--model", str(tiny_pan2), *SMALL,
         "-o", str(out), "--gpus", "2"],
        env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    ranks = {p.stem: json.loads(p.read_text())["processes"]["rank"] for p in out.glob("*[0-9a-z].json")}
    assert ranks == {"000_a-knight": 0, "001_a-torch": 0, "002_b-boat": 1, "003_a-storm": 1, "004_a-wreck": 1}
    assert (out / "000_a-knight.chain.mp4").is_file() and (out / "002_b-boat.chain.mp4").is_file()
    written = (
        run.stdout.split()
    )  # each process prints its own, its rounds in order and its stitched video last
    assert [w for w in written if "b-boat" in w or "storm" in w or "wreck" in w] == [
        str(out / n) for n in ("002_b-boat.mp4", "003_a-storm.mp4", "004_a-wreck.mp4", "002_b-boat.chain.mp4")
    ]
