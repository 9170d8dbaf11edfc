"""Writes that fail after the work is done: a full disk while writing a `.pt` (decode), a latents file or a sidecar,
ffmpeg failing, the rename refused. One `Error:` line naming the file and why, exit 1, never an MP4 without its
sidecar, and (generate) the video's latents kept with the `pan2 decode` command that finishes it.

The full disk is a fake: `pan2cli.atomic`'s files accept `room` bytes and then fail as write(2) does (a short write,
then ENOSPC); torch's own report of it ("unexpected pos") is faked too. With root and tmpfs the same runs against a
real full disk (the issue's commands)."""

from __future__ import annotations

import errno
import json
import os
import shlex
from pathlib import Path

import pytest
import torch

import pan2cli.atomic as atomic
import pan2cli.pipeline.streaming as streaming
from pan2cli.errors import Pan2Error
from pan2cli.video import VideoWriter

CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x64", "--device", "cpu")
_real_open = open


class _FullDisk:
    """A file on a disk with `room` bytes left: a write beyond it is cut short, the next one fails with ENOSPC."""

    def __init__(self, path, mode, room: int, **kwargs):
        self._file = _real_open(path, mode, **kwargs)
        self._room = room

    def write(self, data):
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if self._room <= 0 and size:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if isinstance(data, str):
            data = data[: self._room]
        else:
            data = memoryview(data).cast("B")[: self._room]
        self._room -= len(data)
        return self._file.write(data)

    def flush(self):
        self._file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _fill_disk(monkeypatch, full: Path, room: int = 600):
    """Every file `pan2cli.atomic` writes inside the folder `full` fails after `room` bytes."""

    def fake_open(path, mode="r", **kwargs):
        if Path(path).parent == full:
            return _FullDisk(path, mode, room, **kwargs)
        return _real_open(path, mode, **kwargs)

    monkeypatch.setattr(atomic, "open", fake_open, raising=False)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


# -- pan2 decode -------------------------------------------------------------------------------------------------
def test_a_full_disk_while_decode_writes_a_pt_is_one_error_line(
    run_cli, tiny_vae, latents_file, tmp_path, monkeypatch
):
    """Was a 55-line traceback ending in `unexpected pos 768 vs 662`."""
    full = tmp_path / "full"
    full.mkdir()
    _fill_disk(monkeypatch, full)
    out = full / "x.pt"
    res = run_cli("decode", latents_file(), "--vae", tiny_vae, "--device", "cpu", "-o", out)
    assert res.exit_code == 1
    assert _errors(res.stderr) == [f"Error: could not write {out}: no space left on device"], res.stderr
    assert "Traceback" not in res.stderr and list(full.iterdir()) == []


def test_torch_saves_unexpected_pos_is_said_as_a_full_disk(tmp_path, monkeypatch):
    """torch.save reports a short file as `RuntimeError: ... unexpected pos 704 vs 598`: with no failed write seen and
    no space left in the folder, that is a full disk; with space left, an I/O error."""

    def short_save(obj, f):
        f.write(b"PK\x03\x04")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", short_save)
    stats = os.statvfs(tmp_path)
    for free, reason in ((0, "no space left on device"), (1000, "input/output error")):
        monkeypatch.setattr(
            atomic.os, "statvfs", lambda p, free=free: os.statvfs_result((*stats[:4], free, *stats[5:]))
        )
        with pytest.raises(Pan2Error, match=f"^could not write {tmp_path / 'x.pt'}: {reason}$"):
            atomic.replace_into(tmp_path / "x.pt", lambda tmp: atomic.save_torch({"a": 1}, tmp))
        assert list(tmp_path.iterdir()) == []


# -- pan2 generate ------------------------------------------------------------------------------------------------
def _generate(run_cli, tiny_pan2, out: Path, *extra):
    return run_cli("generate", "x", "--model", tiny_pan2, *CLI_SMALL, "-o", out, *extra)


def _finish_with(hint_line: str) -> list[str]:
    """The `pan2 decode` command at the end of a hint."""
    return shlex.split(hint_line.split("to make the video: ", 1)[1])


def test_a_full_disk_at_the_sidecar_leaves_no_video_and_keeps_the_latents(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    """The sidecar failed after the MP4 was in place: an MP4 without a sidecar, which `--skip-existing` then skipped
    for good, and a traceback. Now the MP4 never shows, the latents are kept and the hint's command makes the video."""
    out = tmp_path / "s.mp4"

    def full_at_the_sidecar(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(streaming, "write_text", full_at_the_sidecar)
        res = _generate(run_cli, tiny_pan2, out)
    assert res.exit_code == 1, res.stderr
    assert _errors(res.stderr) == [f"Error: could not write {tmp_path / 's.json'}: no space left on device"]
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.latents.pt"]  # no video without its sidecar
    (hint,) = [line for line in res.stderr.splitlines() if line.startswith("Hint:")]
    command = _finish_with(hint)
    assert command == [
        "pan2",
        "decode",
        str(tmp_path / "s.latents.pt"),
        "-o",
        str(out),
        "--vae",
        str(tiny_pan2 / "vae"),
    ]
    done = run_cli(*command[1:], "--device", "cpu")
    assert done.exit_code == 0, done.stderr
    assert out.is_file()
    # a resume redoes the video, replacing the leftover latents
    res = _generate(run_cli, tiny_pan2, out, "--skip-existing")
    assert res.exit_code == 0 and res.stdout.split() == [] and "Skipping" in res.stderr


def test_a_full_folder_keeps_the_latents_in_the_temporary_folder(tiny_pan2, run_cli, tmp_path, monkeypatch):
    """`--save-latents` into a folder with no room: the latents file fails, and so does keeping them beside the
    output: they go to the temporary folder, which the hint names."""
    full = tmp_path / "full"
    full.mkdir()
    spare = tmp_path / "tmp"
    spare.mkdir()
    _fill_disk(monkeypatch, full, room=0)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(spare))
    out = full / "s.mp4"
    res = _generate(run_cli, tiny_pan2, out, "--save-latents")
    assert res.exit_code == 1, res.stderr
    assert _errors(res.stderr) == [f"Error: could not write {full / 's.latents.pt'}: no space left on device"]
    assert list(full.iterdir()) == []
    (kept,) = spare.iterdir()
    assert kept.name == f"s.{os.getpid()}.latents.pt"
    (hint,) = [line for line in res.stderr.splitlines() if line.startswith("Hint:")]
    assert _finish_with(hint)[2:4] == [str(kept), "-o"]
    data = torch.load(kept, weights_only=True)
    assert data["latents"].shape == (48, 2, 4, 4) and data["vae"]["vae"] == str(tiny_pan2 / "vae")


@pytest.mark.parametrize("failure", ["ffmpeg", "rename"])
def test_a_video_that_cannot_be_written_keeps_its_latents(failure, tiny_pan2, run_cli, tmp_path, monkeypatch):
    """ffmpeg dying at the end of the encode, or the rename into place refused (permissions): the video's latents
    are kept beside it and nothing else is left (a sidecar written for the video is removed with it)."""
    out = tmp_path / "s.mp4"
    if failure == "ffmpeg":

        def finish(self):
            self.abort()
            raise Pan2Error(f"ffmpeg failed to write {self.path} (exit status 1): simulated")

        monkeypatch.setattr(VideoWriter, "finish", finish)
        message = f"Error: ffmpeg failed to write {out} (exit status 1): simulated"
    else:
        import pan2cli.video as video

        real_replace = os.replace

        def replace(src, dst):
            if Path(dst) == out:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
            return real_replace(src, dst)

        monkeypatch.setattr(video.os, "replace", replace)
        message = f"Error: could not write {out}: permission denied"
    res = _generate(run_cli, tiny_pan2, out)
    assert res.exit_code == 1, res.stderr
    assert _errors(res.stderr) == [message]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.latents.pt"]
    (hint,) = [line for line in res.stderr.splitlines() if line.startswith("Hint:")]
    assert hint.startswith(
        f"Hint: its latents are in {tmp_path / 's.latents.pt'}; to make the video: pan2 decode"
    )


def test_a_batch_reports_a_write_failure_as_that_records_and_goes_on(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    out = tmp_path / "out"
    out.mkdir()
    real_finish = VideoWriter.finish

    def finish(self):
        if "cat" in self.path.name:
            self.abort()
            raise Pan2Error(f"ffmpeg failed to write {self.path} (exit status 1): simulated")
        real_finish(self)

    monkeypatch.setattr(VideoWriter, "finish", finish)
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out, "--crf", 20)
    assert res.exit_code == 1
    assert _errors(res.stderr)[0] == (
        f"Error: {prompts}: prompt 0 (000_a-cat) failed: ffmpeg failed to write {out / '000_a-cat.mp4'} (exit status "
        "1): simulated"
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "000_a-cat.latents.pt",
        "001_a-dog.json",
        "001_a-dog.mp4",
    ]
    (hint,) = [line for line in res.stderr.splitlines() if line.startswith("Hint:")]
    assert _finish_with(hint)[-2:] == ["--crf", "20"]  # the video's own quality
    assert json.loads((out / "001_a-dog.json").read_text())["crf"] == 20
