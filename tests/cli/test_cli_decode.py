"""`pan2 decode` end to end on a tiny checkpoint: outputs, naming, and every bad input (exit 2, no file)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import imageio
import imageio.v3 as iio
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pan2cli.decoding.files as decode_files_module  # where `pan2 decode` opens its decoder
import pan2cli.decoding.write as decode_module  # where every video is decoded (`decode_latents`) and written
from pan2cli.frames import frames_to_uint8
from pan2cli.latents import unnormalize
from pan2cli.vae.checkpoint import load_vae_decoder
from tests.subprocess_env import hooked_env, python_env, wait_while_running


def _frames_on_disk(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _expected_frames(
    vae: Path, latents: torch.Tensor, normalized: bool = True, chunk_latent_frames: int = 4
) -> torch.Tensor:
    """The library's fp32 CPU decode with the CLI's chunking: the same convolutions on the same shapes.

    (A different chunking would be another summation order, which CPUs and BLAS kernels round differently.)
    """
    decoder = load_vae_decoder(vae)
    z = latents[None]
    if normalized:
        z = unnormalize(z, decoder.config.latents_mean, decoder.config.latents_std)
    return frames_to_uint8(decoder.decode(z, chunk_latent_frames)[0])


def test_mp4_has_the_right_frames_size_and_fps(run_cli, tiny_vae, latents_file, tmp_path):
    latents = latents_file((48, 3, 2, 3), fps=12)
    out = tmp_path / "video.mp4"
    result = run_cli("decode", latents, "-o", out, "--vae", tiny_vae)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert "9 frames, 32x48, 12 fps" in result.stderr  # height x width, the order of --size
    # the decode's own seconds, its rate and first frame, and the total with the encode
    figures = re.search(
        r"decode (\d+\.\d+) s \(.*, (\d+\.\d) frames/s, first frame after (\d+\.\d+) s\), total (\d+\.\d+) s",
        result.stderr,
    )
    assert figures, result.stderr
    decode, rate, first, total = map(float, figures.groups())
    assert first <= decode <= total
    assert 9 / (decode + 0.005) - 0.05 <= rate <= 9 / max(decode - 0.005, 1e-3) + 0.05  # decode is rounded
    reader = imageio.get_reader(out, "ffmpeg")
    try:
        frames = list(reader.iter_data())
        assert reader.get_meta_data()["fps"] == 12
    finally:
        reader.close()
    assert len(frames) == 9
    assert frames[0].shape == (32, 48, 3)
    assert _frames_on_disk(tmp_path) == ["latents.pt", "video.mp4"]  # no temporary left


def test_pt_output_equals_the_library_decode(run_cli, tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 3, 2, 3))
    result = run_cli(
        "decode", path, "--format", "pt", "--vae", tiny_vae, "--chunk-latent-frames", "1", "--device", "cpu"
    )
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "latents.frames.pt"  # never the input itself
    assert result.stdout.strip() == str(out)
    frames = torch.load(out, weights_only=True)
    assert frames.dtype == torch.uint8 and frames.shape == (9, 32, 48, 3)
    assert torch.equal(
        frames, _expected_frames(tiny_vae, torch.load(path, weights_only=True), chunk_latent_frames=1)
    )


def test_raw_latents_skip_the_unnormalisation(run_cli, tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 2, 2, 2))
    out = tmp_path / "raw.pt"
    assert (
        run_cli("decode", path, "-o", out, "--raw-latents", "--vae", tiny_vae, "--device", "cpu").exit_code
        == 0
    )
    expected = _expected_frames(tiny_vae, torch.load(path, weights_only=True), normalized=False)
    assert torch.equal(torch.load(out, weights_only=True), expected)


def test_png_folder(run_cli, tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 2, 2, 3))
    result = run_cli("decode", path, "--format", "png", "--vae", tiny_vae)
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "latents"
    names = _frames_on_disk(folder)
    assert len(names) == 5 and names[0] == "frame_00000.png"
    assert iio.imread(folder / names[0]).shape == (32, 48, 3)


def test_several_inputs_and_a_batch_go_to_a_folder(run_cli, tiny_vae, latents_file, tmp_path):
    a = latents_file((48, 2, 2, 2), name="a.pt")
    b = latents_file((2, 48, 1, 2, 2), name="b.pt", seed=1)
    out_dir = tmp_path / "videos"
    out_dir.mkdir()
    result = run_cli("decode", a, b, "-o", out_dir, "--format", "pt", "--vae", tiny_vae)
    assert result.exit_code == 0, result.stderr
    written = [Path(line).name for line in result.stdout.split()]
    assert written == ["a.pt", "b_0.pt", "b_1.pt"]
    assert torch.load(out_dir / "b_1.pt", weights_only=True).shape == (1, 32, 32, 3)


def test_existing_output_needs_overwrite(run_cli, tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 1, 2, 2))
    out = tmp_path / "v.mp4"
    out.write_bytes(b"keep me")
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae)
    assert result.exit_code == 2
    assert "Error:" in result.stderr and "--overwrite" in result.stderr
    assert out.read_bytes() == b"keep me"
    assert run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--overwrite").exit_code == 0
    assert out.read_bytes() != b"keep me"


def _bad_latents(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "bad.pt"
    gen = torch.Generator().manual_seed(0)
    if kind == "rank":
        torch.save(torch.randn(48, 3, 4, generator=gen), path)
    elif kind == "channels":
        torch.save(torch.randn(16, 2, 2, 2, generator=gen), path)
    elif kind == "nan":
        bad = torch.randn(48, 2, 2, 2, generator=gen)
        bad[0, 0, 0, 0] = float("nan")
        torch.save(bad, path)
    elif kind == "inf":
        bad = torch.randn(48, 2, 2, 2, generator=gen)
        bad[1, 1, 1, 1] = float("inf")
        torch.save(bad, path)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("not a tensor\n")
    elif kind == "object":
        torch.save({"latents": torch.randn(48, 1, 2, 2, generator=gen), "extra": Path("x")}, path)
    elif kind == "truncated_safetensors":
        path = tmp_path / "bad.safetensors"
        save_file({"latents": torch.randn(48, 4, 8, 8, generator=gen)}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "no_latents_key":
        torch.save({"z": torch.randn(48, 1, 2, 2, generator=gen)}, path)
    return path


@pytest.mark.parametrize(
    "kind",
    ["rank", "channels", "nan", "inf", "empty", "text", "object", "truncated_safetensors", "no_latents_key"],
)
def test_bad_latents_exit_2_without_output(run_cli, tiny_vae, tmp_path, kind):
    path = _bad_latents(tmp_path, kind)
    before = set(tmp_path.iterdir())
    result = run_cli("decode", path, "--vae", tiny_vae)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith("Error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert set(tmp_path.iterdir()) == before


def test_bad_checkpoint_exits_2(run_cli, latents_file, tmp_path):
    other = tmp_path / "other_model.safetensors"
    save_file({"model.layers.0.weight": torch.randn(4, 4, generator=torch.Generator().manual_seed(0))}, other)
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", other)
    assert result.exit_code == 2
    assert "not a Wan VAE checkpoint" in result.stderr
    assert not (tmp_path / "latents.mp4").exists()


def test_missing_vae_path_exits_2(run_cli, latents_file, tmp_path):
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tmp_path / "nope" / "Wan2.2_VAE.pth")
    assert result.exit_code == 2
    assert "no such file" in result.stderr


@pytest.mark.parametrize("where", ["missing_folder", "file_as_folder"])
def test_unwritable_output_location_exits_2(run_cli, tiny_vae, latents_file, tmp_path, where):
    path = latents_file((48, 1, 2, 2))
    if where == "missing_folder":
        out = tmp_path / "no" / "such" / "v.mp4"
    else:
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "v.mp4"
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae)
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ")


def test_one_output_file_for_several_videos_is_refused(run_cli, tiny_vae, latents_file, tmp_path):
    a = latents_file((48, 1, 2, 2), name="a.pt")
    b = latents_file((48, 1, 2, 2), name="b.pt")
    result = run_cli("decode", a, b, "-o", tmp_path / "one.mp4", "--vae", tiny_vae)
    assert result.exit_code == 2
    assert "existing folder" in result.stderr


def test_ctrl_c_removes_the_partial_output_and_exits_130(
    run_cli, tiny_vae, latents_file, tmp_path, monkeypatch
):
    real_decode = decode_module.decode_latents

    def interrupted(decoder, latents, writer, **kwargs):
        def chunk_then_interrupt(n):
            raise KeyboardInterrupt

        return real_decode(
            decoder,
            latents,
            writer,
            on_chunk=chunk_then_interrupt,
            **{k: v for k, v in kwargs.items() if k != "on_chunk"},
        )

    monkeypatch.setattr(decode_module, "decode_latents", interrupted)
    path = latents_file((48, 3, 2, 2))
    result = run_cli("decode", path, "--vae", tiny_vae)
    assert result.exit_code == 130
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


def test_out_of_memory_is_a_known_failure(run_cli, tiny_vae, latents_file, tmp_path, monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.60 GiB")

    monkeypatch.setattr(decode_module, "decode_latents", oom)
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tiny_vae)
    assert result.exit_code == 1
    assert "Error: CUDA out of memory" in result.stderr.splitlines()[-2]
    assert "--chunk-latent-frames" in result.stderr
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


def _pan2(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    environment = python_env(**(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "pan2cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
    )


def test_offline_without_cache_says_how_to_pass_a_path(latents_file, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = _pan2("decode", latents_file((48, 1, 2, 2)), "--vae", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", env=env)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: could not download the VAE")
    assert "--vae PATH" in proc.stderr
    assert "Traceback" not in proc.stderr


def _closed_port_endpoint() -> str:
    """An endpoint whose port refuses connections: bound (the OS chooses the port) and never listening, the
    socket kept open until the test process ends so that no other process can bind the port meanwhile.

    Kept open: a socket closed before use frees its port, which another process could then listen on."""
    import atexit

    s = socket.socket()  # no SO_REUSEADDR: a second bind of the port fails while this socket holds it
    s.bind(("127.0.0.1", 0))
    atexit.register(s.close)  # holds the socket until then
    return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_hub_without_cache_fails_at_once(latents_file, tmp_path):
    endpoint = _closed_port_endpoint()
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    proc = _pan2(
        "decode", latents_file((48, 1, 2, 2)), "--device", "cpu", env=env
    )  # the default --vae, from the hub
    assert proc.returncode == 1, proc.stderr
    # huggingface_hub's own retries (25 s) each say "Retrying in …": none may happen (no clock needed)
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        f"Error: could not download the VAE from Wan-AI/Wan2.2-TI2V-5B-Diffusers: the Hugging Face hub ({endpoint}) "
        "is unreachable and no copy is cached",
        "Hint: pass --vae PATH to a local Wan2.2_VAE.pth, wan2.2_vae.safetensors or diffusers vae/ folder",
    ]


def test_unreachable_hub_uses_the_cached_copy(tiny_vae, latents_file, tmp_path):
    # huggingface_hub's cache layout: refs/main names the snapshot that holds the files.
    repo = tmp_path / "hf" / "hub" / "models--Wan-AI--Wan2.2-TI2V-5B-Diffusers"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_vae, repo / "snapshots" / commit / "vae")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    endpoint = _closed_port_endpoint()
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    proc = _pan2("decode", latents_file((48, 1, 2, 2)), "--device", "cpu", "-o", tmp_path / "out.pt", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "out.pt")
    assert "Retrying" not in proc.stderr
    said = [line for line in proc.stderr.splitlines() if "Hugging Face hub" in line]
    assert said == [f"Warning: the Hugging Face hub ({endpoint}) is unreachable; using the local cache"]


# Loaded through PYTHONPATH: the decode stops after its first chunk until a signal comes.
_SLOW_DECODE = """
import time
import pan2cli.vae.model as model
real = model.WanVAEDecoder.decode_chunks

def decode_chunks(self, *args, **kwargs):
    chunks = real(self, *args, **kwargs)
    yield next(chunks)
    time.sleep(120)
    yield from chunks

model.WanVAEDecoder.decode_chunks = decode_chunks
"""


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_sigterm_removes_the_partial_output_and_exits_143(tiny_vae, latents_file, tmp_path):
    latents = latents_file((48, 3, 2, 2))
    env = hooked_env(tmp_path, _SLOW_DECODE)
    cmd = [
        sys.executable,
        "-m",
        "pan2cli",
        "decode",
        str(latents),
        "--vae",
        str(tiny_vae),
        "--device",
        "cpu",
        "-o",
        "out.mp4",
    ]
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        writing = lambda: any(p.name.startswith(".out.mp4.partial") for p in tmp_path.iterdir())
        wait_while_running(proc, writing, time.monotonic() + 60)
        proc.send_signal(signal.SIGTERM)  # what `kill` and job schedulers send
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "Terminated.", err
    assert "Error" not in err and "Traceback" not in err and out == ""
    assert _frames_on_disk(tmp_path) == ["hook", "latents.pt"]


def test_python_dash_m_from_a_source_tree(tmp_path):
    proc = _pan2("--version", cwd=tmp_path)
    assert proc.returncode == 0
    assert proc.stdout.startswith("pan2 ")


# -o means what it says: the suffix chooses the format, a trailing slash a folder, an input is never replaced.
# Through the installed entry point in a subprocess, as a user runs it.


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("x.png", "Hint: pass --format png -o x/"),  # PNG frames go to a folder
        ("x.avi", "Hint: name the file x.mp4"),
        ("video", "Hint: name the file video.mp4"),  # no suffix: no guess
    ],
)
def test_output_suffix_that_names_no_format_is_refused(tiny_vae, latents_file, tmp_path, name, says):
    proc = _pan2("decode", latents_file((48, 1, 2, 2)), "-o", name, "--vae", tiny_vae, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"Error: -o {name}")
    assert says in proc.stderr and "Traceback" not in proc.stderr
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


@pytest.mark.parametrize(("name", "fmt"), [("x.mp4", "pt"), ("x.pt", "mp4"), ("x.mp4", "png")])
def test_output_suffix_and_format_that_disagree_are_refused(tiny_vae, latents_file, tmp_path, name, fmt):
    proc = _pan2(
        "decode", latents_file((48, 1, 2, 2)), "-o", tmp_path / name, "--format", fmt, "--vae", tiny_vae
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: ") and f"--format is {fmt}" in proc.stderr
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


def test_output_suffix_chooses_the_format(tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 2, 2, 2))
    proc = _pan2("decode", path, "-o", tmp_path / "x.PT", "--vae", tiny_vae, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert torch.load(tmp_path / "x.PT", weights_only=True).shape == (5, 32, 32, 3)
    proc = _pan2(
        "decode", path, "-o", tmp_path / "frames", "--format", "png", "--vae", tiny_vae, "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "frames")
    assert len(_frames_on_disk(tmp_path / "frames")) == 5


def test_trailing_slash_names_a_folder_that_must_exist(tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 1, 2, 2))
    proc = _pan2("decode", path, "-o", f"{tmp_path / 'newdir'}/", "--vae", tiny_vae)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: ") and "does not exist" in proc.stderr
    assert _frames_on_disk(tmp_path) == ["latents.pt"]  # no file named newdir
    (tmp_path / "newdir").mkdir()
    proc = _pan2("decode", path, "-o", f"{tmp_path / 'newdir'}/", "--vae", tiny_vae, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert _frames_on_disk(tmp_path / "newdir") == ["latents.mp4"]


def test_png_frames_go_to_the_folder_named_with_a_slash(tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 1, 2, 2))
    args = (
        "decode",
        path,
        "--format",
        "png",
        "-o",
        f"{tmp_path / 'frames'}/",
        "--vae",
        tiny_vae,
        "--device",
        "cpu",
    )
    proc = _pan2(*args)
    assert proc.returncode == 0, proc.stderr
    assert _frames_on_disk(tmp_path / "frames") == ["frame_00000.png"]
    proc = _pan2(*args)  # the same command again: the same folder, which now exists
    assert proc.returncode == 2 and "already exists" in proc.stderr
    (tmp_path / "frames" / "notes.txt").write_text("mine")
    proc = _pan2(*args, "--overwrite")  # a folder that holds more than frames is never replaced
    assert proc.returncode == 2 and "notes.txt" in proc.stderr
    assert _frames_on_disk(tmp_path / "frames") == ["frame_00000.png", "notes.txt"]


@pytest.mark.parametrize("how", ["same_path", "symlink", "hard_link"])
def test_an_output_that_is_an_input_is_refused(tiny_vae, latents_file, tmp_path, how):
    path = latents_file((48, 1, 2, 2))
    before = path.read_bytes()
    out = path
    if how == "symlink":
        out = tmp_path / "link.pt"
        out.symlink_to(path)
    elif how == "hard_link":
        out = tmp_path / "hard.pt"
        os.link(path, out)
    proc = _pan2("decode", path, "-o", out, "--overwrite", "--vae", tiny_vae)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Error: ") and "is the input" in proc.stderr
    assert path.read_bytes() == before and out.read_bytes() == before


def test_several_inputs_into_a_missing_folder_say_so(tiny_vae, latents_file, tmp_path):
    a = latents_file((48, 1, 2, 2), name="a.pt")
    b = latents_file((48, 1, 2, 2), name="b.pt")
    for out in (f"{tmp_path / 'videos'}/", tmp_path / "videos"):
        proc = _pan2("decode", a, b, "-o", out, "--vae", tiny_vae)
        assert proc.returncode == 2
        assert f"folder {tmp_path / 'videos'} does not exist" in proc.stderr
        assert "names one file" not in proc.stderr
    assert _frames_on_disk(tmp_path) == ["a.pt", "b.pt"]


def test_a_batch_into_one_name_writes_numbered_files(tiny_vae, latents_file, tmp_path):
    path = latents_file((2, 48, 1, 2, 2), name="b.pt")
    proc = _pan2("decode", path, "-o", tmp_path / "clip.mp4", "--vae", tiny_vae, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "clip_0.mp4"), str(tmp_path / "clip_1.mp4")]
    assert _frames_on_disk(tmp_path) == ["b.pt", "clip_0.mp4", "clip_1.mp4"]


def test_bf16_on_the_cpu_warns_and_runs(run_cli, tiny_vae, latents_file, tmp_path):
    path = latents_file((48, 1, 2, 2))
    result = run_cli(
        "decode", path, "--vae", tiny_vae, "--device", "cpu", "--dtype", "bf16", "-o", tmp_path / "bf16.mp4"
    )
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and "slower" in warnings[0] and "--dtype fp32" in warnings[0]
    # no factor: "about 40x" was false on a CPU with AVX512-BF16 (20.1 s against fp32's 23.6 s)
    assert "much slower than fp32 on most CPUs" in warnings[0] and "40x" not in warnings[0]
    assert (tmp_path / "bf16.mp4").is_file()
    result = run_cli("decode", path, "--vae", tiny_vae, "--device", "cpu", "-o", tmp_path / "fp32.mp4")
    assert result.exit_code == 0 and "Warning:" not in result.stderr


_REPORT_HEAVY_MODULES = """
import atexit, os, sys
HEAVY = ("transformers", "diffusers", "torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp")
atexit.register(lambda: open(os.environ["PAN2_TEST_MODULES"], "w").write(" ".join(m for m in HEAVY if m in sys.modules)))
"""


def test_a_decode_imports_nothing_heavy(tiny_vae, latents_file, tmp_path):
    """`pan2 decode` stays lean: no transformers, and none of torch's compiler stack (3 s)."""
    report = tmp_path / "modules.txt"
    env = hooked_env(tmp_path, _REPORT_HEAVY_MODULES, PAN2_TEST_MODULES=str(report))
    command = [
        sys.executable,
        "-m",
        "pan2cli",
        "decode",
        str(latents_file((48, 2, 2, 3))),
        "--vae",
        str(tiny_vae),
        "-o",
        str(tmp_path / "v.mp4"),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert report.read_text() == ""


def test_x264_preset_reaches_the_encoder(run_cli, tiny_vae, latents_file, tmp_path):
    """`--x264-preset` changes the encode (the same frames, another bitstream); a name x264 lacks is bad input."""
    latents = latents_file((48, 3, 2, 3))
    sizes = {}
    for preset in ("ultrafast", "veryslow"):
        result = run_cli(
            "decode", latents, "--vae", tiny_vae, "-o", tmp_path / f"{preset}.mp4", "--x264-preset", preset
        )
        assert result.exit_code == 0, result.stderr
        sizes[preset] = (tmp_path / f"{preset}.mp4").read_bytes()
    assert sizes["ultrafast"] != sizes["veryslow"]
    result = run_cli("decode", latents, "--vae", tiny_vae, "-o", tmp_path / "x.mp4", "--x264-preset", "quick")
    assert result.exit_code == 2 and "--x264-preset" in result.stderr


# Every option reaches the decode or the file, every batch item is its own video, and the MP4 holds
# the decode's frames in order. Each test below failed with the bug it names put into the code by hand.


def _mp4_frames(path: Path) -> tuple[torch.Tensor, float]:
    """The frames of an MP4 (uint8 [F, H, W, 3]) and the frame rate its container states."""
    reader = imageio.get_reader(path, "ffmpeg")
    try:
        frames = torch.from_numpy(
            np.stack(list(reader.iter_data()))
        )  # iter_data: len(reader) is inf for a stream
        return frames, reader.get_meta_data()["fps"]
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("chunk", "chunks"),
    [
        (
            1,
            [1, 4, 4, 4, 4],
        ),  # 5 latent frames: the first alone (1 video frame), then 4 video frames per latent frame
        (3, [1, 12, 4]),
        (None, [1, 16]),  # the default, 4
    ],
)
def test_chunk_latent_frames_sets_the_decoder_passes(
    run_cli, tiny_vae, latents_file, tmp_path, writer_chunks, chunk, chunks
):
    """`--chunk-latent-frames` reaches the decoder (the bug: the CLI not passing the value on, so
    every decode ran in chunks of 4). The frames are the same whatever the chunk size (the design), so the
    visible effect is the decoder passes: each hands the writer its frames in one piece."""
    path = latents_file((48, 5, 2, 2))
    out = tmp_path / "v.pt"
    option = () if chunk is None else ("--chunk-latent-frames", chunk)
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--device", "cpu", *option)
    assert result.exit_code == 0, result.stderr
    assert writer_chunks == chunks
    frames = torch.load(out, weights_only=True)
    # The same video whatever the passes: another summation order may flip a rounding, no more (measured: 1
    # level with one latent frame per pass, float frames 2e-6 apart; 0 with 3).
    expected = _expected_frames(tiny_vae, torch.load(path, weights_only=True))
    assert frames.shape == expected.shape == (17, 32, 32, 3)
    assert (frames.int() - expected.int()).abs().max() <= 1


def _luma(frames: torch.Tensor) -> torch.Tensor:
    """BT.601 luma of uint8 [..., 3] frames, in float64 on [0, 255]."""
    return frames.double() @ torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)


def _psnr_db(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two float64 images on [0, 255]."""
    mse = (a - b).square().mean().item()
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_mp4_holds_the_frames_of_the_decode_in_order(run_cli, tiny_vae, latents_file, tmp_path):
    """The MP4 holds the decode's frames, each in its place (the bug: frames shifted by one, the
    first dropped and the last doubled; a mean error bound let it through). The .pt output of the same
    decode is the reference. The random-weight decoder draws pixel-scale noise that yuv420p's halved chroma
    cannot carry (13 dB per pixel in RGB even at --crf 0), so luma, which H.264 keeps at full resolution, is
    compared: each frame must match its own .pt frame and be closer to it than to the frames beside it."""
    path = latents_file((48, 3, 2, 3))
    mp4, pt = tmp_path / "v.mp4", tmp_path / "v.pt"
    for out in (mp4, pt):
        result = run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--device", "cpu")
        assert result.exit_code == 0, result.stderr
    video, _ = _mp4_frames(mp4)
    reference = torch.load(pt, weights_only=True)
    assert video.shape == reference.shape == (9, 32, 48, 3)
    luma, expected = _luma(video), _luma(reference)
    for i in range(len(video)):
        own = _psnr_db(luma[i], expected[i])
        assert own >= 30, (
            i,
            own,
        )  # measured 34.0-36.4 dB at the default --crf 17; a neighbour frame: 14.0-15.1 dB
        for j in (i - 1, i + 1):
            if 0 <= j < len(video):
                assert own > _psnr_db(luma[i], expected[j]), (i, j)


def test_each_batch_item_is_decoded_from_its_own_latents(run_cli, tiny_vae, latents_file, tmp_path):
    """Batch item i is decoded from latents[i] (the bug: every item written from item 0). Each
    video of a batch [2, 48, T, H, W] equals the decode of that item alone, from a file of its own: the same
    shapes and the same convolutions, so the same frames."""
    path = latents_file((2, 48, 2, 2, 3), name="batch.pt")
    batch = torch.load(path, weights_only=True)
    result = run_cli("decode", path, "-o", tmp_path / "b.pt", "--vae", tiny_vae, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    videos = [torch.load(tmp_path / f"b_{i}.pt", weights_only=True) for i in range(2)]
    assert not torch.equal(videos[0], videos[1])
    for i, video in enumerate(videos):
        single = tmp_path / f"item{i}.pt"
        torch.save(batch[i].clone(), single)
        out = tmp_path / f"single{i}.pt"
        result = run_cli("decode", single, "-o", out, "--vae", tiny_vae, "--device", "cpu")
        assert result.exit_code == 0, result.stderr
        assert torch.equal(video, torch.load(out, weights_only=True)), i


def test_fps_option_sets_the_container_frame_rate(run_cli, tiny_vae, latents_file, tmp_path):
    """`--fps` wins over the latents file's `fps` (the bug: the CLI ignoring the option's value)."""
    path = latents_file((48, 2, 2, 2), fps=12)
    out = tmp_path / "v.mp4"
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--fps", "30")
    assert result.exit_code == 0, result.stderr
    assert "5 frames, 32x32, 30 fps" in result.stderr
    frames, fps = _mp4_frames(out)
    assert len(frames) == 5 and fps == 30


def test_crf_option_reaches_the_encoder(run_cli, tiny_vae, latents_file, tmp_path):
    """`--crf` reaches x264 (the bug: the CLI ignoring the option's value): the same frames make a
    strictly smaller file as the quality factor grows (measured 22669, 8639 and 2499 bytes)."""
    path = latents_file((48, 3, 2, 3))
    sizes = []
    for crf in (0, 17, 35):
        out = tmp_path / f"crf{crf}.mp4"
        result = run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--crf", crf)
        assert result.exit_code == 0, result.stderr
        sizes.append(out.stat().st_size)
    assert sizes[0] > sizes[1] > sizes[2], sizes


def test_quiet_prints_nothing_on_stderr(run_cli, tiny_vae, latents_file, tmp_path):
    """`-q` silences stderr entirely, the path written still on stdout (the bug: the option
    ignored, the loading line and the summary printed)."""
    path = latents_file((48, 1, 2, 2))
    loud = run_cli("decode", path, "-o", tmp_path / "loud.mp4", "--vae", tiny_vae, "--device", "cpu")
    assert loud.exit_code == 0, loud.stderr
    assert "Loaded the VAE decoder" in loud.stderr and "1 frames, 32x32" in loud.stderr
    quiet = run_cli("decode", path, "-o", tmp_path / "quiet.mp4", "--vae", tiny_vae, "--device", "cpu", "-q")
    assert quiet.exit_code == 0
    assert quiet.stderr == ""
    assert quiet.stdout == f"{tmp_path / 'quiet.mp4'}\n"
    assert (tmp_path / "quiet.mp4").is_file()


def test_unknown_option_with_valid_inputs_is_a_usage_error(run_cli, tiny_vae, latents_file, tmp_path):
    """An unknown option is refused even when everything else is valid (the test in
    test_cli_misc.py names a missing input, which exits 2 whatever happens to the option)."""
    path = latents_file((48, 1, 2, 2))
    result = run_cli("decode", path, "-o", tmp_path / "v.mp4", "--vae", tiny_vae, "--no-such-option")
    assert result.exit_code == 2
    assert "Error: No such option '--no-such-option'." in result.stderr
    assert result.stdout == ""
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


# What a new user hit, each test failing on the code before its fix.


def _no_vae_load(monkeypatch):
    """Make loading the VAE a test failure: the checks under test must come first."""

    def loaded(*args, **kwargs):
        raise AssertionError("the VAE was loaded before the inputs were checked")

    monkeypatch.setattr(decode_files_module, "open_decoder", loaded)


@pytest.mark.parametrize("fps", ["nan", "inf", "1e-9", "0.005", "1000.5", "1e9", "0", "-24"])
def test_a_frame_rate_an_mp4_cannot_carry_is_refused_before_the_vae_loads(
    run_cli, tiny_vae, latents_file, tmp_path, monkeypatch, fps
):
    """`--fps` from 0.01 to 1000 (pan2cli.outputs.MIN_FPS, MAX_FPS), refused while parsing: 1e-9 decoded the whole
    video before ffmpeg failed (exit 1), 1e9 wrote a file stating "1001k fps", nan and inf were refused only after
    the VAE had loaded."""
    _no_vae_load(monkeypatch)
    result = run_cli(
        "decode", latents_file((48, 1, 2, 2)), "-o", tmp_path / "v.mp4", "--vae", tiny_vae, "--fps", fps
    )
    assert result.exit_code == 2, result.stderr
    assert "Error: Invalid value for '--fps'" in result.stderr and "Traceback" not in result.stderr
    assert _frames_on_disk(tmp_path) == ["latents.pt"]


def test_a_latents_files_frame_rate_is_checked_before_the_vae_loads(
    run_cli, tiny_vae, latents_file, tmp_path, monkeypatch
):
    """A latents file's `fps` out of range is refused before the VAE loads, naming the file; `--fps` overrides it."""
    path = latents_file((48, 1, 2, 2), fps=1e9)
    with monkeypatch.context() as patch:
        _no_vae_load(patch)
        result = run_cli("decode", path, "-o", tmp_path / "v.mp4", "--vae", tiny_vae)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"Error: latents file {path}: its fps 1e+09 is outside 0.01 to 1000 frames per second, the rates an H.264 MP4 carries",
        "Hint: pass --fps F to choose the frame rate",
    ]
    result = run_cli("decode", path, "-o", tmp_path / "v.mp4", "--vae", tiny_vae, "--fps", 25)
    assert result.exit_code == 0, result.stderr
    assert _mp4_frames(tmp_path / "v.mp4")[1] == 25


def test_output_on_stdout_is_refused_with_a_hint(run_cli, tiny_vae, latents_file, tmp_path, monkeypatch):
    """`-o -` got "Hint: name the file -.mp4"; pan2 writes files, and says so."""
    _no_vae_load(monkeypatch)
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "-o", "-", "--vae", tiny_vae)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "Error: -o -: pan2 writes video to files, not to stdout (an MP4 is finished by seeking back into it)",
        "Hint: name a file, e.g. -o video.mp4 (the path written is printed on stdout)",
    ]


def test_device_is_echoed_as_given(run_cli, tiny_vae, latents_file, monkeypatch):
    """`--device cuda:1` was echoed as `--device cuda:` on a machine without CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tiny_vae, "--device", "cuda:1")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == "Error: --device cuda:1: CUDA is not available on this machine"


def test_revision_reaches_the_hub(run_cli, tiny_vae, latents_file, tmp_path, monkeypatch):
    """`--revision` reaches the hub's download (the bug: the main branch fetched instead).
    huggingface_hub's download is replaced by one that records the revision and serves the tiny VAE."""
    import huggingface_hub

    import pan2cli.checkpoints.hub as hub

    asked = []

    def download(repo_id, filename, *, subfolder=None, revision=None, **kwargs):
        asked.append((repo_id, subfolder, filename, revision))
        return str(tiny_vae / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(hub, "_use_the_cache_if_unreachable", lambda: None)  # no network probe
    out = tmp_path / "v.pt"
    result = run_cli(
        "decode", latents_file((48, 1, 2, 2)), "-o", out, "--vae", "org/vae", "--revision", "v1.2"
    )
    assert result.exit_code == 0, result.stderr
    assert {revision for *_, revision in asked} == {"v1.2"} and (
        "org/vae",
        "vae",
        "config.json",
        "v1.2",
    ) in asked
    assert "Warning" not in result.stderr


def test_revision_with_a_local_vae_says_it_is_ignored(run_cli, tiny_vae, latents_file, tmp_path):
    """`--revision` names a commit of a hub repo: beside a local `--vae` it changes nothing, and one line says so."""
    result = run_cli(
        "decode", latents_file((48, 1, 2, 2)), "-o", tmp_path / "v.pt", "--vae", tiny_vae, "--revision", "v1"
    )
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert warnings == [
        f"Warning: --revision v1 is ignored: --vae {tiny_vae} is a local path, not a Hugging Face repo"
    ]


def test_a_file_that_appears_at_the_output_during_the_decode_is_kept(
    run_cli, tiny_vae, latents_file, tmp_path, monkeypatch
):
    """The writer's commit checks the target again: a file written there while the decode ran
    (another run, another user) is kept, exit 2 with one clear line, no temporary left; `--overwrite` replaces it."""
    real_decode = decode_module.decode_latents
    out = tmp_path / "v.mp4"

    def decode_while_another_writes(*args, **kwargs):
        stats = real_decode(*args, **kwargs)
        out.write_bytes(b"another run's video")
        return stats

    monkeypatch.setattr(decode_module, "decode_latents", decode_while_another_writes)
    path = latents_file((48, 2, 2, 2))
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae)
    assert result.exit_code == 2, result.stderr
    assert result.stderr.splitlines()[-2:] == [
        f"Error: output {out} already exists",
        "Hint: pass --overwrite to replace it",
    ]
    assert out.read_bytes() == b"another run's video" and result.stdout == ""
    assert _frames_on_disk(tmp_path) == ["latents.pt", "v.mp4"]
    out.unlink()
    result = run_cli("decode", path, "-o", out, "--vae", tiny_vae, "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert len(_mp4_frames(out)[0]) == 5
