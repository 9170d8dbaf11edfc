"""Tests for pan2cli.frames and pan2cli.video: float-to-uint8 mapping, output paths, and the mp4/png/pt writers."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from pan2cli.errors import InputError, Pan2Error
from pan2cli.frames import copy_to_host, frames_to_uint8, psnr
from pan2cli.outputs import DEFAULT_CRF, OUTPUT_FORMATS, check_output_path, default_output_path
from pan2cli.video import VideoWriter, open_video_writer, write_video


def _gradient_frames(f: int, h: int, w: int) -> torch.Tensor:
    """Smooth moving colour gradients (uint8 [f, h, w, 3]) that H.264 reproduces closely."""
    t = torch.arange(f, dtype=torch.float32).view(f, 1, 1)
    y = torch.linspace(0, 1, h).view(1, h, 1)
    x = torch.linspace(0, 1, w).view(1, 1, w)
    r = 40 + 170 * x + 4 * t
    g = 30 + 180 * y - 2 * t
    b = 60 + 90 * (x + y) / 2 + 3 * t
    return torch.stack(torch.broadcast_tensors(r, g, b), dim=-1).round().clamp(0, 255).to(torch.uint8)


def _moving_frames(f: int, h: int, w: int) -> torch.Tensor:
    """Smooth colour waves (uint8 [f, h, w, 3]) that travel a third of a period per frame: H.264 keeps each
    frame closely, and each frame is far from the frames beside it (7.4 dB apart)."""
    t = torch.arange(f, dtype=torch.float32).view(f, 1, 1) * (2 * math.pi * 0.3)
    y = torch.linspace(0, 2 * math.pi, h).view(1, h, 1)
    x = torch.linspace(0, 2 * math.pi, w).view(1, 1, w)
    r = 128 + 90 * torch.sin(1.5 * x + t)
    g = 128 + 90 * torch.sin(y - t)
    b = 128 + 90 * torch.cos(0.5 * (x + y) + 2 * t)
    return torch.stack(torch.broadcast_tensors(r, g, b), dim=-1).round().clamp(0, 255).to(torch.uint8)


def _read_mp4(path: Path) -> tuple[np.ndarray, float]:
    """The frames (uint8 [F, H, W, 3]) and the frame rate of an MP4: PyAV where installed, else imageio's ffmpeg."""
    try:
        return iio.imread(path, plugin="pyav"), iio.immeta(path, plugin="pyav")["fps"]
    except (ImportError, ValueError):
        import imageio

        with imageio.get_reader(path, "ffmpeg") as reader:
            # iter_data, not list(reader): the reader's len() is inf for a stream.
            return np.stack(list(reader.iter_data())), reader.get_meta_data()["fps"]


def _random_frames(f: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (f, h, w, 3), generator=g, dtype=torch.uint8)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------- frames_to_uint8


def test_frames_to_uint8_known_values() -> None:
    values = torch.tensor([-1.0, 1.0, 0.0, -2.0, 3.5, -1.0 + 1 / 127.5, 0.999])
    video = values.view(1, 1, 1, -1).expand(3, 1, 1, -1)  # [3, F=1, H=1, W=7]
    out = frames_to_uint8(video)
    assert out.dtype == torch.uint8
    assert out.shape == (1, 1, 7, 3)
    # 0 -> 127.5 -> 128 (round half to even), outside [-1, 1] clamps to 0 / 255.
    assert out[0, 0, :, 0].tolist() == [0, 255, 128, 0, 255, 1, 255]
    assert torch.equal(out[..., 0], out[..., 1]) and torch.equal(out[..., 0], out[..., 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_frames_to_uint8_layout(dtype: torch.dtype) -> None:
    # Each value encodes its own (channel, frame, row, column): the output must put
    # channel last and keep every pixel where it was.
    c, f, h, w = torch.meshgrid(
        torch.arange(3), torch.arange(2), torch.arange(3), torch.arange(4), indexing="ij"
    )
    code = c * 64 + f * 16 + h * 4 + w  # 0..191, exact in bf16 after the mapping below
    video = (code.float() / 127.5 - 1.0).to(dtype)
    out = frames_to_uint8(video)
    assert out.shape == (2, 3, 4, 3) and out.is_contiguous()
    expected = code.permute(1, 2, 3, 0).to(torch.uint8)
    # Exact in every dtype (measured 0 levels off in fp16 and bf16, where a bound of 1 stood): code / 127.5 - 1
    # lies in [-1, 0.5), where bf16 rounds by at most 2^-9, a quarter of a level, so the mapping's rounding
    # brings the code back. Elementwise IEEE arithmetic, no reduction: the same on every CPU.
    assert torch.equal(out, expected)


def test_frames_to_uint8_rejects_bad_shape() -> None:
    with pytest.raises(ValueError):
        frames_to_uint8(torch.rand(2, 4, 4, 3, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError):
        frames_to_uint8(torch.zeros(3, 1, 2, 2, dtype=torch.uint8))


def test_copy_to_host_cpu_is_identity() -> None:
    t = _random_frames(2, 4, 4)
    assert copy_to_host(t) is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_to_host_cuda() -> None:
    video = (torch.rand(3, 4, 16, 24, generator=torch.Generator().manual_seed(0)) * 2 - 1).to("cuda")
    frames = frames_to_uint8(video)
    assert frames.device == video.device
    host = copy_to_host(frames)
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, frames_to_uint8(video.cpu()))


# ---------------------------------------------------------------- output paths


def test_default_output_path() -> None:
    assert default_output_path(Path("/d/x.pt"), "mp4") == Path("/d/x.mp4")
    assert default_output_path(Path("/d/x.safetensors"), "png") == Path("/d/x")
    assert default_output_path(Path("/d/x.safetensors"), "pt") == Path("/d/x.pt")
    # Never the input itself.
    assert default_output_path(Path("/d/x.pt"), "pt") == Path("/d/x.frames.pt")
    assert default_output_path(Path("/d/x"), "png") == Path("/d/x.frames")
    with pytest.raises(InputError):
        default_output_path(Path("/d/x.pt"), "gif")
    assert OUTPUT_FORMATS == ("mp4", "png", "pt") and DEFAULT_CRF == 17


def test_check_output_path(tmp_path: Path) -> None:
    check_output_path(tmp_path / "new.mp4", overwrite=False)
    with pytest.raises(InputError, match="does not exist"):
        check_output_path(tmp_path / "missing" / "x.mp4", overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="not a folder"):
        check_output_path(tmp_path / "file" / "x.mp4", overwrite=True)
    (tmp_path / "old.mp4").write_text("x")
    with pytest.raises(InputError) as info:
        check_output_path(tmp_path / "old.mp4", overwrite=False)
    assert "--overwrite" in (info.value.hint or "")
    check_output_path(tmp_path / "old.mp4", overwrite=True)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write anywhere")
def test_check_output_path_read_only_folder(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(InputError, match="not writable"):
            check_output_path(ro / "x.mp4", overwrite=False)
    finally:
        ro.chmod(0o755)


def test_bad_writer_arguments(tmp_path: Path) -> None:
    for kwargs in ({"fps": 0}, {"fps": float("nan")}, {"crf": 52}, {"crf": -1}):
        args = {"fps": 12.0, "crf": DEFAULT_CRF} | kwargs
        with pytest.raises(InputError):
            open_video_writer(tmp_path / "x.mp4", "mp4", **args)
    with pytest.raises(InputError):
        open_video_writer(tmp_path / "x.gif", "gif", fps=12.0)
    (tmp_path / "dir.mp4").mkdir()
    with pytest.raises(InputError, match="folder"):
        open_video_writer(tmp_path / "dir.mp4", "mp4", fps=12.0, overwrite=True)


# ---------------------------------------------------------------- round trips


# imageio's ffmpeg reader leaves its subprocess pipes to the garbage collector (not our code).
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_mp4_round_trip(tmp_path: Path) -> None:
    frames = _gradient_frames(9, 64, 96)
    path = tmp_path / "clip.mp4"
    with open_video_writer(path, "mp4", fps=12.0) as writer:
        assert isinstance(writer, VideoWriter)
        writer.write(frames[:5])
        writer.write(frames[5:])
        assert writer.frames_written == 9
    assert _listing(tmp_path) == ["clip.mp4"]
    back, fps = _read_mp4(path)
    assert back.shape == (9, 64, 96, 3)
    assert fps == pytest.approx(12.0)
    err = np.abs(back.astype(np.float32) - frames.numpy().astype(np.float32)).mean()
    assert err < 2.0, (
        err
    )  # measured 1.53 (x264, crf 17, preset faster); frames shifted by one way or the other: 2.63, 3.21


@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_mp4_keeps_every_frame_in_its_place(tmp_path: Path) -> None:
    """Frame i of the MP4 is frame i written (the bug: frames shifted by one, the first dropped and
    the last doubled, which a mean error bound over slowly changing frames let through). Written in chunks
    of 1, 4 and 4 frames as `pan2 decode` writes them; each frame must match its source and be closer to
    it than to the frames beside it."""
    frames = _moving_frames(9, 64, 96)
    path = tmp_path / "clip.mp4"
    with open_video_writer(path, "mp4", fps=12.0) as writer:
        for chunk in (frames[:1], frames[1:5], frames[5:]):
            writer.write(chunk)
    back, _ = _read_mp4(path)
    assert back.shape == (9, 64, 96, 3)
    back = torch.from_numpy(back)
    for i in range(9):
        own = psnr(back[i], frames[i])
        assert own >= 32, (i, own)  # measured 36.2-37.3 dB at crf 17; a neighbour frame: 7.4 dB
        for j in (i - 1, i + 1):
            if 0 <= j < 9:
                assert own > psnr(back[i], frames[j]), (i, j)


def test_png_round_trip(tmp_path: Path) -> None:
    frames = _random_frames(5, 6, 7)  # odd sizes are fine for png
    path = tmp_path / "clip"
    with open_video_writer(path, "png", fps=12.0) as writer:
        writer.write(frames[:2])
        writer.write(frames[2:])
    assert _listing(tmp_path) == ["clip"]
    assert _listing(path) == [f"frame_{i:05d}.png" for i in range(5)]
    for i in range(5):
        assert np.array_equal(iio.imread(path / f"frame_{i:05d}.png"), frames[i].numpy())


def test_pt_round_trip(tmp_path: Path) -> None:
    frames = _random_frames(4, 5, 3)
    path = tmp_path / "clip.pt"
    with open_video_writer(path, "pt", fps=12.0) as writer:
        writer.write(frames[:1])
        writer.write(frames[1:])
    assert _listing(tmp_path) == ["clip.pt"]
    back = torch.load(path, weights_only=True)
    assert back.dtype == torch.uint8 and torch.equal(back, frames)


def test_write_video(tmp_path: Path) -> None:
    frames = _random_frames(3, 4, 4)
    out = write_video(frames, tmp_path / "v.pt", "pt", fps=8.0)
    assert out == tmp_path / "v.pt"
    assert torch.equal(torch.load(out, weights_only=True), frames)


# ---------------------------------------------------------------- overwrite, abort, errors


@pytest.mark.parametrize("fmt", ["pt", "png"])
def test_overwrite(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / ("clip.pt" if fmt == "pt" else "clip")
    write_video(_random_frames(2, 4, 4, seed=1), path, fmt, fps=12.0)
    new = _random_frames(3, 4, 4, seed=2)
    with pytest.raises(InputError, match="already exists"):
        write_video(new, path, fmt, fps=12.0)
    write_video(new, path, fmt, fps=12.0, overwrite=True)
    assert _listing(tmp_path) == [path.name]
    if fmt == "pt":
        assert torch.equal(torch.load(path, weights_only=True), new)
    else:
        assert _listing(path) == [f"frame_{i:05d}.png" for i in range(3)]
        assert np.array_equal(iio.imread(path / "frame_00002.png"), new[2].numpy())


def test_missing_parent_folder(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        open_video_writer(tmp_path / "no" / "clip.mp4", "mp4", fps=12.0)


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_abort_leaves_nothing(tmp_path: Path, fmt: str, exc: type[BaseException]) -> None:
    path = tmp_path / f"clip.{fmt}"
    with pytest.raises(exc):
        with open_video_writer(path, fmt, fps=12.0) as writer:
            writer.write(_gradient_frames(3, 16, 16))
            if fmt == "png":
                assert writer.tmp_path.is_dir()
            elif fmt == "mp4":  # ffmpeg creates its output once it has a frame: wait for it
                deadline = time.monotonic() + 10
                while not writer.tmp_path.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert writer.tmp_path.is_file()
            raise exc()
    assert _listing(tmp_path) == []


def test_abort_keeps_existing_output(tmp_path: Path) -> None:
    path = tmp_path / "clip.pt"
    old = _random_frames(1, 2, 2)
    torch.save(old, path)
    with pytest.raises(RuntimeError):
        with open_video_writer(path, "pt", fps=12.0, overwrite=True) as writer:
            writer.write(_random_frames(2, 2, 2))
            raise RuntimeError()
    assert _listing(tmp_path) == ["clip.pt"]
    assert torch.equal(torch.load(path, weights_only=True), old)


@pytest.mark.parametrize("size", [(16, 15), (15, 16)])
def test_odd_size_mp4(tmp_path: Path, size: tuple[int, int]) -> None:
    h, w = size
    with pytest.raises(InputError, match="even"):
        with open_video_writer(tmp_path / "clip.mp4", "mp4", fps=12.0) as writer:
            writer.write(_gradient_frames(2, h, w))
    assert _listing(tmp_path) == []


def test_no_frames_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(Pan2Error, match="no frames"):
        with open_video_writer(tmp_path / "clip.mp4", "mp4", fps=12.0):
            pass
    assert _listing(tmp_path) == []


def test_bad_chunks(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        with open_video_writer(tmp_path / "clip.pt", "pt", fps=12.0) as writer:
            writer.write(_random_frames(2, 4, 4))
            writer.write(_random_frames(2, 4, 6))  # size changed
    with pytest.raises(ValueError):
        with open_video_writer(tmp_path / "clip.pt", "pt", fps=12.0) as writer:
            writer.write(torch.rand(2, 4, 4, 3, generator=torch.Generator().manual_seed(0)))  # not uint8
    assert _listing(tmp_path) == []


def test_ffmpeg_failure_is_pan2error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An impossible x264 preset (past open_video_writer's check) makes ffmpeg exit with an error; the
    # message must name the output.
    path = tmp_path / "clip.mp4"
    with pytest.raises(Pan2Error, match="clip.mp4"):
        with VideoWriter(path, "mp4", 12.0, DEFAULT_CRF, False, preset="no-such-preset") as writer:
            writer.write(_gradient_frames(2, 16, 16))
    with pytest.raises(InputError, match="x264 preset must be one of"):
        open_video_writer(path, "mp4", fps=12.0, preset="no-such-preset")
    assert _listing(tmp_path) == []


_FFMPEG_WAITING_FOR_GO = """#!{python}
import os, sys, time
go = os.path.join(os.path.dirname(sys.argv[-1]), "go")
while not os.path.exists(go):  # an encoder far slower than the decode: it reads nothing for now
    time.sleep(0.05)
with open(sys.argv[-1], "wb") as out:
    out.write(sys.stdin.buffer.read())
"""


def test_mp4_writes_return_while_the_encoder_is_busy(tmp_path, monkeypatch):
    """The decode hands chunks over and goes on; before, a write into a full pipe waited for
    ffmpeg (and under a row split every rank waited with it). The stand-in ffmpeg reads nothing until
    told to: every write must still return, and the file must then hold every byte in order."""
    import imageio_ffmpeg

    fake = tmp_path / "ffmpeg"
    fake.write_text(_FFMPEG_WAITING_FOR_GO.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(fake))
    gen = torch.Generator().manual_seed(0)
    chunks = [
        torch.randint(0, 256, (4, 64, 96, 3), dtype=torch.uint8, generator=gen) for _ in range(8)
    ]  # 8 x 72 KiB: more than a pipe holds
    writer = open_video_writer(tmp_path / "out.mp4", "mp4", 24.0)
    writing = threading.Thread(target=lambda: [writer.write(c) for c in chunks], daemon=True)
    writing.start()
    writing.join(timeout=60)
    assert not writing.is_alive(), "write() waited for the encoder"
    (tmp_path / "go").touch()
    writer.commit()
    assert (tmp_path / "out.mp4").read_bytes() == b"".join(c.numpy().tobytes() for c in chunks)


@pytest.mark.parametrize("fmt", OUTPUT_FORMATS)
def test_commit_keeps_a_file_that_appeared_while_writing(tmp_path: Path, fmt: str) -> None:
    """The commit checks the target again: a file that appeared at the output path while the frames
    were written is not replaced without `overwrite` (InputError, nothing of ours left), and is with it."""
    path = tmp_path / f"clip.{fmt}"
    frames = _gradient_frames(3, 16, 16)
    with pytest.raises(InputError, match="already exists"):
        with open_video_writer(path, fmt, fps=12.0) as writer:
            writer.write(frames)
            path.write_bytes(b"another run's file")
    assert path.read_bytes() == b"another run's file" and _listing(tmp_path) == [path.name]
    with open_video_writer(path, fmt, fps=12.0, overwrite=True) as writer:
        writer.write(frames)
    assert _listing(tmp_path) == [path.name] and (path.is_dir() or path.read_bytes() != b"another run's file")


@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("fps", "beyond"), [(0.01, 0.0099), (1000.0, 1000.5)])
def test_mp4_at_the_frame_rate_limits(tmp_path: Path, fps: float, beyond: float) -> None:
    """The limits of `--fps` (pan2cli.outputs.MIN_FPS, MAX_FPS) are frame rates ffmpeg writes and reads
    back; just beyond them the writer refuses before anything is written (1e-9 failed in ffmpeg at the end)."""
    path = tmp_path / "clip.mp4"
    write_video(_gradient_frames(5, 16, 16), path, "mp4", fps=fps)
    back, stated = _read_mp4(path)
    assert back.shape == (5, 16, 16, 3)
    # ffmpeg states 1000 fps as "1k fps", which imageio's ffmpeg reader parses as 0 (PyAV reads 1000)
    assert stated == pytest.approx(fps) or (fps == 1000 and stated == 0)
    with pytest.raises(InputError, match="frames per second"):
        open_video_writer(tmp_path / "other.mp4", "mp4", fps=beyond)
    assert _listing(tmp_path) == ["clip.mp4"]
