"""`pan2 decode` as a library (`pan2cli.decoding`): `decode_files` without the command, and the one decode-and-write
routine's contract (written whole or not at all, what goes beside it written before the video shows, an output
another process wrote meanwhile kept)."""

from __future__ import annotations

import pytest
import torch

from pan2cli.config import RuntimeConfig
from pan2cli.decoding.files import DecodeRequest, decode_files
from pan2cli.decoding.write import VideoTarget, decode_and_write
from pan2cli.errors import InputError
from pan2cli.vae.checkpoint import load_vae_decoder


def test_decode_files_writes_each_video_and_returns_what_it_did(tiny_vae, latents_file, tmp_path):
    """Two files, one a batch of two, into a folder: three videos, each handed to `on_written` as it is written, the
    decoder loaded once (said once through `info`), the chunk the default's (1 frame, then 4 latent frames)."""
    one = latents_file((48, 3, 2, 3), name="one.pt", fps=12)
    two = latents_file((2, 48, 2, 2, 3), name="two.pt", seed=1)
    out = tmp_path / "out"
    out.mkdir()
    lines, seen = [], []
    videos = decode_files(
        DecodeRequest([one, two], output=str(out), vae=str(tiny_vae), fmt="pt"),
        RuntimeConfig(device="cpu"),
        info=lines.append,
        on_written=seen.append,
    )
    assert videos == seen
    assert [(v.source.name, v.index, v.output.name, v.fps) for v in videos] == [
        ("one.pt", 0, "one.pt", 12.0),
        ("two.pt", 0, "two_0.pt", 24.0),
        ("two.pt", 1, "two_1.pt", 24.0),
    ]
    assert [torch.load(v.output).shape for v in videos] == [(9, 32, 48, 3), (5, 32, 48, 3), (5, 32, 48, 3)]
    assert videos[0].stats.frames == 9 and videos[0].decoder == "reference decoder"
    assert sum(line.startswith("Loaded the VAE decoder") for line in lines) == 1
    with pytest.raises(InputError, match="already exists"):  # checked before the decoder loads
        decode_files(
            DecodeRequest([one], output=str(out), vae=str(tiny_vae), fmt="pt"), RuntimeConfig(device="cpu")
        )


@pytest.fixture(scope="module")
def decoder(tiny_vae):
    return load_vae_decoder(tiny_vae)


def _latents() -> torch.Tensor:
    return torch.randn(48, 2, 2, 2, generator=torch.Generator().manual_seed(0))


def test_what_goes_beside_a_video_is_written_before_it_shows_and_its_failure_leaves_none(decoder, tmp_path):
    target = VideoTarget(tmp_path / "v.mp4", "mp4", 24.0)
    seen = []
    video = decode_and_write(
        decoder, _latents(), target, chunk_latent_frames=4, keep_frames=True,
        before_commit=lambda: seen.append(target.path.exists()),
    )  # fmt: skip
    assert seen == [False] and video.output == target.path and video.frames.shape == (5, 32, 32, 3)

    def full_disk():
        raise OSError(28, "No space left on device")

    failing = VideoTarget(tmp_path / "w.mp4", "mp4", 24.0)
    with pytest.raises(OSError):
        decode_and_write(decoder, _latents(), failing, chunk_latent_frames=4, before_commit=full_disk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]  # no w.mp4, no temporary file


@pytest.mark.parametrize("skip_if_taken", [True, False])
def test_an_output_another_process_wrote_meanwhile_is_kept(decoder, tmp_path, skip_if_taken):
    """Written by someone else while the decode ran: skipped (`--skip-existing`) or an error, and never replaced."""
    target = VideoTarget(tmp_path / "v.mp4", "mp4", 24.0, skip_if_taken=skip_if_taken)

    def progress(total):
        target.path.write_bytes(b"theirs")  # as the decode starts
        from contextlib import nullcontext

        return nullcontext(lambda n=1: None)

    if skip_if_taken:
        video = decode_and_write(decoder, _latents(), target, chunk_latent_frames=4, progress=progress)
        assert video.skipped and video.output is None
    else:
        with pytest.raises(InputError, match="already exists"):
            decode_and_write(decoder, _latents(), target, chunk_latent_frames=4, progress=progress)
    assert target.path.read_bytes() == b"theirs" and [p.name for p in tmp_path.iterdir()] == ["v.mp4"]
