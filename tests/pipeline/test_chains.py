"""Rounds of a world (`pan2cli.pipeline.chains`, `pan2cli.pipeline.rounds`): records that continue each other run in
order, each from the exact last frame of the round before; one stitched MP4 per chain; `--continue-from` an MP4 or a
latents file; a resumed chain regenerates nothing finished; a failing round stops only its chain; bad input refused
before any work; chains whole on one rank.

The frames compared are the uint8 frames each MP4 writer received (H.264 is lossy: what is read back from an MP4 is
not what was written). Where the files themselves are compared, the videos are written with `--crf 0`: x264 is then
lossless on the yuv420p frames, so the same RGB frame decodes to the same pixels wherever it stands in a stream.
"""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch

import pan2cli.pipeline.generator as generator_module
from pan2cli.errors import InputError, Pan2Error
from pan2cli.pipeline.generator import VideoGenerator
from pan2cli.pipeline.prompts import chains, read_prompt_file, shard
from pan2cli.pipeline.rounds import ChainRounds
from pan2cli.video import VideoWriter

# 8 fps: a record's duration 0.5 gives 5 frames, 1 gives 9.
CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x64", "--fps", 8, "--device", "cpu")
THREE_ROUNDS = [
    {"prompt": "a knight walks into a forest", "duration": 0.5, "name": "forest"},
    {"prompt": "he lights a torch", "continue": True, "duration": 1, "seed": 7},
    {"prompt": "a dragon lands", "continue": True, "duration": 0.5, "negative_prompt": "blurry"},
]
ROUND_NAMES = ["000_forest", "001_he-lights-a-torch", "002_a-dragon-lands"]


def _mp4_frames(path) -> np.ndarray:
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    width, height = next(reader)["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader])


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


@pytest.fixture
def written(monkeypatch):
    """`written(name)`: the uint8 frames the writer of the file `name` received, in order (every run of the test)."""
    frames: dict[str, list[torch.Tensor]] = {}
    real = VideoWriter.write

    def write(self, chunk):
        frames.setdefault(self.path.name, []).append(chunk.clone())
        return real(self, chunk)

    monkeypatch.setattr(VideoWriter, "write", write)
    return lambda name: torch.cat(frames.pop(name))


@pytest.fixture
def starts(monkeypatch):
    """Output name → (the start image a round was given as uint8 `[H, W, 3]`, its VAE latent), and the prompts
    denoised (`starts["denoised"]`), for every job of the test."""
    seen: dict = {"denoised": []}
    real_encode, real_sample = ChainRounds._encode_start, VideoGenerator.sample

    def encode_start(self, state, image, states):
        real_encode(self, state, image, states)
        seen[state.job.output.name] = (np.asarray(image).copy(), state.image_latent.clone())

    def sample(self, model, settings, cond, uncond, image_latent=None, **kwargs):
        seen["denoised"].append(settings.prompt)
        seen[f"latent {settings.prompt}"] = image_latent
        return real_sample(self, model, settings, cond, uncond, image_latent, **kwargs)

    monkeypatch.setattr(ChainRounds, "_encode_start", encode_start)
    monkeypatch.setattr(VideoGenerator, "sample", sample)
    return seen


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if `pan2 generate` gets as far as locating the checkpoint."""

    def located(*args, **kwargs):
        pytest.fail("the checkpoint was located: a model was about to load")

    monkeypatch.setattr(generator_module, "resolve_components", located)


def _write_rounds(tmp_path, records=THREE_ROUNDS, name="world.json"):
    prompts = tmp_path / name
    prompts.write_text(json.dumps(records))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return prompts, out


# -- the syntax -----------------------------------------------------------------------------------------------------
def test_rounds_read_the_same_in_json_json_lines_and_text(tmp_path):
    records = [{"prompt": "a"}, {"prompt": "b", "continue": True}, {"prompt": "c", "continue": True}, "d",
               {"prompt": "e", "continue": True}]  # fmt: skip
    (tmp_path / "w.json").write_text(json.dumps(records))
    (tmp_path / "w.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "w.txt").write_text("a\n+ b\n# a comment\n+ c\nd\n\n+ e\n")
    for name in ("w.json", "w.jsonl", "w.txt"):
        parsed, warnings = read_prompt_file(tmp_path / name)
        assert [(r.prompt, r.continues) for r in parsed] == [
            ("a", False), ("b", True), ("c", True), ("d", False), ("e", True),
        ], name  # fmt: skip
        assert [[r.index for r in chain] for chain in chains(parsed)] == [[0, 1, 2], [3, 4]] and not warnings


def test_a_round_takes_no_image_and_a_bad_continue_is_its_records_problem(tmp_path):
    (tmp_path / "w.json").write_text(json.dumps([
        "a", {"prompt": "b", "continue": True, "image": "x.png"}, {"prompt": "c", "continue": "yes"},
    ]))  # fmt: skip
    parsed, _ = read_prompt_file(tmp_path / "w.json")
    assert "continues the record before it" in str(parsed[1].problem) and "takes no 'image'" in str(
        parsed[1].problem
    )
    assert "'continue' must be true or false" in str(parsed[2].problem)
    assert parsed[1].continues and not parsed[2].continues  # a problem record still belongs to its chain


def test_help_says_how_rounds_and_gpus_go_together(run_cli):
    text = " ".join(run_cli("generate", "--help").stdout.split())
    assert (
        "with --gpus N, whole chains go to the processes, a chain's rounds one after another on one" in text
    )
    assert '"continue": true (a text line starting with "+")' in text and "--continue-from VIDEO" in text


def test_shard_keeps_each_chain_on_one_rank(tmp_path):
    """A chain's rounds wait for each other: the ranks share chains, not records."""
    (tmp_path / "w.txt").write_text("a\n+ a2\n+ a3\nb\nc\n+ c2\nd\n")
    parsed, _ = read_prompt_file(tmp_path / "w.txt")
    ranks = [[r.prompt for r in shard(parsed, rank, 2)] for rank in (0, 1)]
    assert ranks == [["a", "a2", "a3", "c", "c2"], ["b", "d"]]
    plain = [r for r in parsed if not r.continues]  # no chains: every world-th record, as before
    assert [r.prompt for r in shard(plain, 1, 2)] == ["b", "d"]


def test_image_starts_a_chain_and_its_rounds_start_from_the_round_before(tmp_path):
    """`--image` is the start of each chain's first round only: a round's settings and sidecar overrides hold none."""
    from pan2cli.pipeline.batch_plan import plan_jobs
    from pan2cli.presets import load_preset

    prompts, out = _write_rounds(tmp_path, ["a", {"prompt": "b", "continue": True}, "c"])
    flags = {"image": tmp_path / "start.png", "steps": 1}
    jobs, failures, *_ = plan_jobs(None, prompts, str(out), load_preset("pan2-5s"), flags)
    assert not failures and [j.settings.image for j in jobs] == [
        tmp_path / "start.png",
        None,
        tmp_path / "start.png",
    ]
    assert ["image" in j.metadata["overrides"] for j in jobs] == [True, False, True]
    assert [j.chain.position if j.chain else None for j in jobs] == [0, 1, None]
    assert jobs[1].chain.previous is jobs[0] and jobs[0].chain.chain is jobs[1].chain.chain


# -- a chain ---------------------------------------------------------------------------------------------------------
def test_three_rounds_start_from_the_exact_last_frames_and_stitch(
    tiny_pan2, run_cli, tmp_path, written, starts
):
    prompts, out = _write_rounds(tmp_path)
    res = run_cli(
        "generate",
        "--prompts",
        prompts,
        "--model",
        tiny_pan2,
        *CLI_SMALL,
        "--crf",
        0,
        "--save-latents",
        "-o",
        out,
    )
    assert res.exit_code == 0, res.stderr
    stitched = out / "000_forest.chain.mp4"
    assert res.stdout.split() == [*(str(out / f"{n}.mp4") for n in ROUND_NAMES), str(stitched)]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            stitched.name,
            *(f"{n}.{ext}" for n in ROUND_NAMES for ext in ("mp4", "json", "last.png", "latents.pt")),
        ]
    )
    rounds = [written(f"{n}.mp4") for n in ROUND_NAMES]
    assert [len(r) for r in rounds] == [5, 9, 5]
    # Each round starts from the exact uint8 last frame the writer of the round before received, also in its PNG.
    for before, name, frames in zip(ROUND_NAMES, ROUND_NAMES[1:], rounds):
        image, _ = starts[f"{name}.mp4"]
        assert np.array_equal(image, frames[-1].numpy())
        assert np.array_equal(iio.imread(out / f"{before}.last.png"), frames[-1].numpy())
    assert "000_forest.mp4" not in starts  # the first round is text-to-video
    # The stitched video: F1 + F2 + F3 − 2 frames, each seam once, the rounds' own frames.
    assert torch.equal(written(stitched.name), torch.cat([rounds[0], rounds[1][1:], rounds[2][1:]]))
    decoded = [_mp4_frames(out / f"{n}.mp4") for n in ROUND_NAMES]  # lossless at crf 0 on the yuv420p frames
    assert np.array_equal(_mp4_frames(stitched), np.concatenate([decoded[0], decoded[1][1:], decoded[2][1:]]))
    # Each sidecar: its own prompt, seed, duration, negative prompt; what it continued; where it is in the stitch.
    sides = [json.loads((out / f"{n}.json").read_text()) for n in ROUND_NAMES]
    assert [(s["prompt"], s["frames"], s["seed"]) for s in sides] == [
        ("a knight walks into a forest", 5, 123), ("he lights a torch", 9, 7), ("a dragon lands", 5, 123),
    ]  # fmt: skip
    assert sides[2]["negative_prompt"] == "blurry" and sides[1]["image"] is None
    assert sides[0]["continues"] is None
    assert sides[2]["continues"] == {
        "video": str(out / "001_he-lights-a-torch.mp4"), "frame": 8,
        "frame_file": str(out / "001_he-lights-a-torch.last.png"), "index": 1, "name": None,
    }  # fmt: skip
    assert [s["chain"] for s in sides] == [
        {"video": str(stitched), "round": k + 1, "rounds": 3, "offset": offset}
        for k, offset in enumerate((0, 4, 12))
    ]
    # One batch: every model loaded once, every prompt encoded before the first round, the encoder once.
    loads = sides[2]["shared_loads"]
    assert loads["load_transformer"]["videos"] == 3 and loads["load_text_encoder"]["videos"] == 3
    assert loads["load_vae_encoder"]["videos"] == 2

    # Round 2's start latent is `--image` of round 1's PNG: the same path from the frame on.
    res = run_cli(
        "generate", "he lights a torch", "--model", tiny_pan2, *CLI_SMALL, "--frames", 9, "--seed", 7,
        "--image", out / "000_forest.last.png", "-o", tmp_path / "alone.mp4",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert torch.equal(starts["latent he lights a torch"], starts["001_he-lights-a-torch.mp4"][1])
    assert torch.equal(written("alone.mp4"), rounds[1])  # and so the same video


def test_a_round_runs_as_soon_as_the_round_before_is_written(
    tiny_pan2, run_cli, tmp_path, starts, monkeypatch
):
    """Round k + 1 waits for round k's frames and files (written before it begins), and for nothing of another
    chain; the other chain's rounds run after, in file order."""
    prompts = tmp_path / "w.txt"
    prompts.write_text("a\n+ b\nc\n+ d\n")
    out = tmp_path / "out"
    out.mkdir()
    seen = []
    real = VideoGenerator._denoise
    monkeypatch.setattr(
        VideoGenerator, "_denoise", lambda self, state: (seen.append(sorted(p.name for p in out.glob("[!.]*.mp4"))), real(self, state))
    )  # fmt: skip
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert starts["denoised"] == ["a", "b", "c", "d"]
    assert seen == [[], ["000_a.mp4"], ["000_a.chain.mp4", "000_a.mp4", "001_b.mp4"],
                    ["000_a.chain.mp4", "000_a.mp4", "001_b.mp4", "002_c.mp4"]]  # fmt: skip


def test_without_room_for_the_decoder_a_continued_round_is_decoded_in_the_transformers_room(
    tiny_pan2, run_cli, tmp_path, written, monkeypatch
):
    """Where the decoder does not fit beside the transformer, the batch decodes after the last denoising; a round
    that the next one starts from cannot wait: the transformer is released for its decode and read again."""
    import pan2cli.pipeline.memory as memory

    monkeypatch.setattr(memory, "free_memory", lambda device, cap_gib=None: (2**20, "the GPU"))
    reads, resident = [], []
    real_read, real_decode = VideoGenerator._read_dit, VideoGenerator._decode_one
    monkeypatch.setattr(
        VideoGenerator, "_read_dit", lambda self, *a, **k: reads.append(1) or real_read(self, *a, **k)
    )
    monkeypatch.setattr(
        VideoGenerator, "_decode_one", lambda self, *a: resident.append(self._dit is not None) or real_decode(self, *a)
    )  # fmt: skip
    prompts = tmp_path / "w.txt"
    prompts.write_text("a\n+ b\nc\n")
    out = tmp_path / "out"
    out.mkdir()
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert (
        "Decoding 000_a.mp4 now, as the next round starts from it: the transformer is released" in res.stderr
    )
    assert len(reads) == 2 and resident == [False, False, False]
    a, b = written("000_a.mp4"), written("001_b.mp4")
    assert torch.equal(written("000_a.chain.mp4"), torch.cat([a, b[1:]]))
    assert sorted(p.name for p in out.glob("*.mp4")) == [
        "000_a.chain.mp4",
        "000_a.mp4",
        "001_b.mp4",
        "002_c.mp4",
    ]


# -- --continue-from -------------------------------------------------------------------------------------------------
def test_continue_from_an_mp4_and_a_latents_file(tiny_pan2, run_cli, tmp_path, written, starts):
    first = tmp_path / "first.mp4"
    res = run_cli(
        "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--save-latents", "--crf", 0, "-o", first
    )
    assert res.exit_code == 0, res.stderr
    made = written("first.mp4")
    assert not (tmp_path / "first.last.png").exists()  # a video of its own: no round

    # From the MP4: its last frame as read back (lossy), and its frames before the round's in the stitched video.
    res = run_cli(
        "generate", "the cat jumps", "--model", tiny_pan2, *CLI_SMALL, "--crf", 0, "--continue-from", first,
        "-o", tmp_path / "jump.mp4",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == [str(tmp_path / "jump.mp4"), str(tmp_path / "jump.chain.mp4")]
    decoded = _mp4_frames(first)
    assert np.array_equal(starts["jump.mp4"][0], decoded[-1])
    jump = written("jump.mp4")
    assert torch.equal(written("jump.chain.mp4"), torch.cat([torch.from_numpy(decoded), jump[1:]]))
    side = json.loads((tmp_path / "jump.json").read_text())
    assert side["continues"] == {"video": str(first), "frame": 4, "frame_file": None}
    assert side["chain"] == {"video": str(tmp_path / "jump.chain.mp4"), "round": 1, "rounds": 1, "offset": 4}

    # From the latents file: decoded by the checkpoint's VAE, the exact frames the first video's writer received.
    res = run_cli(
        "generate", "the cat jumps", "--model", tiny_pan2, *CLI_SMALL, "--continue-from",
        tmp_path / "first.latents.pt", "-o", tmp_path / "leap.mp4",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(starts["leap.mp4"][0], made[-1].numpy())
    assert torch.equal(written("leap.chain.mp4"), torch.cat([made, written("leap.mp4")[1:]]))

    # An MP4 that pan2 wrote as a round has its exact last frame beside it: that frame, not the MP4's.
    res = run_cli(
        "generate", "the cat lands", "--model", tiny_pan2, *CLI_SMALL, "--continue-from", tmp_path / "leap.mp4",
        "-o", tmp_path / "land.mp4",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(starts["land.mp4"][0], iio.imread(tmp_path / "leap.last.png"))
    assert json.loads((tmp_path / "land.json").read_text())["continues"]["frame_file"] == str(
        tmp_path / "leap.last.png"
    )


def test_continue_from_latents_of_another_vae_is_refused_before_any_model_loads(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    first = tmp_path / "first.mp4"
    assert (
        run_cli(
            "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--save-latents", "-o", first
        ).exit_code
        == 0
    )
    payload = torch.load(tmp_path / "first.latents.pt", weights_only=True)
    payload["vae"]["latent_statistics"] = "0" * 16
    torch.save(payload, tmp_path / "other.latents.pt")
    monkeypatch.setattr(VideoGenerator, "_read_dit", lambda *a, **k: pytest.fail("the transformer was read"))
    res = run_cli(
        "generate", "x", "--model", tiny_pan2, *CLI_SMALL, "--continue-from", tmp_path / "other.latents.pt",
        "-o", tmp_path / "x.mp4",
    )  # fmt: skip
    assert res.exit_code == 2
    assert _errors(res.stderr) == [
        f"Error: --continue-from {tmp_path / 'other.latents.pt'} holds latents made for the VAE {tiny_pan2 / 'vae'}, "
        f"and the model's ({tiny_pan2 / 'vae'}) is another: its latent statistics (latents_mean, latents_std) are others"
    ]


def test_continue_from_with_a_file_of_rounds(tiny_pan2, run_cli, tmp_path, written, starts):
    """The first round of each chain starts from the video; its stitched video begins with the video."""
    first = tmp_path / "first.mp4"
    assert run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", first).exit_code == 0
    made = written("first.mp4")
    prompts = tmp_path / "w.txt"
    prompts.write_text("it sits\n+ it sleeps\n")
    out = tmp_path / "out"
    out.mkdir()
    res = run_cli(
        "generate",
        "--prompts",
        prompts,
        "--model",
        tiny_pan2,
        *CLI_SMALL,
        "--continue-from",
        first,
        "-o",
        out,
    )
    assert res.exit_code == 0, res.stderr
    assert np.array_equal(starts["000_it-sits.mp4"][0], _mp4_frames(first)[-1])
    stitched = written("000_it-sits.chain.mp4")
    assert len(stitched) == len(made) + 5 - 1 + 5 - 1
    assert torch.equal(
        stitched[len(made) :], torch.cat([written("000_it-sits.mp4")[1:], written("001_it-sleeps.mp4")[1:]])
    )


# -- resuming, failures ----------------------------------------------------------------------------------------------
def test_a_resumed_chain_regenerates_nothing_finished(
    tiny_pan2, run_cli, tmp_path, written, starts, monkeypatch
):
    prompts, out = _write_rounds(tmp_path)
    args = ("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL)
    whole = tmp_path / "whole"
    whole.mkdir()
    assert run_cli(*args, "-o", whole).exit_code == 0
    uninterrupted = [written(f"{n}.mp4") for n in ROUND_NAMES]
    written("000_forest.chain.mp4")

    real = VideoGenerator._denoise

    def stop_at_the_third(self, state):
        if state.job.settings.prompt == "a dragon lands":
            raise KeyboardInterrupt
        return real(self, state)

    with monkeypatch.context() as patch:
        patch.setattr(VideoGenerator, "_denoise", stop_at_the_third)
        res = run_cli(*args, "-o", out)
    assert res.exit_code == 130, res.stderr
    assert len(written("000_forest.chain.mp4")) == 5 + 9 - 1  # begun, then dropped
    finished = sorted(f"{n}.{ext}" for n in ROUND_NAMES[:2] for ext in ("mp4", "json", "last.png"))
    assert sorted(p.name for p in out.iterdir()) == finished  # no stitched video, no temporary file
    mtimes = {name: (out / name).stat().st_mtime_ns for name in finished}

    starts["denoised"].clear()
    res = run_cli(*args, "-o", out, "--skip-existing")
    assert res.exit_code == 0, res.stderr
    assert starts["denoised"] == ["a dragon lands"]  # nothing finished is made again
    assert {name: (out / name).stat().st_mtime_ns for name in finished} == mtimes
    # it starts from the exact frame of the round before, so the chain is the uninterrupted one
    assert np.array_equal(
        starts["002_a-dragon-lands.mp4"][0], iio.imread(out / "001_he-lights-a-torch.last.png")
    )
    assert torch.equal(written("002_a-dragon-lands.mp4"), uninterrupted[2])
    # the rounds made before are read back from their MP4s into the stitched video (F1 + F2 + F3 − 2 frames)
    assert len(written("000_forest.chain.mp4")) == 5 + 9 + 5 - 2
    assert "Skipping" in res.stderr and str(out / "000_forest.chain.mp4") in res.stdout.split()


def test_only_a_missing_stitched_video_is_made_from_the_files_without_loading_a_model(
    tiny_pan2, run_cli, tmp_path, written
):
    prompts, out = _write_rounds(tmp_path)
    args = ("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "--crf", 0, "-o", out)
    assert run_cli(*args).exit_code == 0
    stitched = out / "000_forest.chain.mp4"
    before = _mp4_frames(stitched)
    stitched.unlink()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            generator_module, "resolve_components", lambda *a, **k: pytest.fail("a model was located")
        )
        res = run_cli(*args, "--skip-existing")
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == [str(stitched)] and "0 video(s) written, 3 skipped, 0 failed." in res.stderr
    assert _mp4_frames(stitched).shape == before.shape


def test_a_failing_round_stops_only_its_chain(tiny_pan2, run_cli, tmp_path, monkeypatch):
    prompts = tmp_path / "w.txt"
    prompts.write_text("a\n+ b fails\n+ c\nd\n+ e\n")
    out = tmp_path / "out"
    out.mkdir()
    real = VideoGenerator.sample

    def failing(self, model, settings, *args, **kwargs):
        if settings.prompt == "b fails":
            raise Pan2Error("simulated failure")
        return real(self, model, settings, *args, **kwargs)

    monkeypatch.setattr(VideoGenerator, "sample", failing)
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 1
    assert _errors(res.stderr) == [
        f"Error: {prompts}: prompt 1 (001_b-fails) failed: simulated failure",
        f"Error: {prompts}: prompt 2 (002_c) not made: it continues prompt 1 (001_b-fails), which was not made",
        "Error: 2 prompt(s) failed (see above)",
    ]
    assert sorted(p.name for p in out.glob("*.mp4")) == [
        "000_a.mp4",
        "003_d.chain.mp4",
        "003_d.mp4",
        "004_e.mp4",
    ]
    assert not [p for p in out.iterdir() if "partial" in p.name]


def test_a_record_that_cannot_run_stops_its_chain_before_any_work(tiny_pan2, run_cli, tmp_path, starts):
    prompts, out = _write_rounds(
        tmp_path, [*THREE_ROUNDS[:1], {**THREE_ROUNDS[1], "seed": -1}, THREE_ROUNDS[2], "x"]
    )
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 1
    errors = _errors(res.stderr)
    assert errors[0].startswith(f"Error: {prompts}: prompt 1: 'seed' must be")
    assert (
        errors[1]
        == f"Error: {prompts}: prompt 2 (002_a-dragon-lands) not made: it continues prompt 1 (001), which cannot run"
    )
    assert starts["denoised"] == ["a knight walks into a forest", "x"]


# -- bad input -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case, message",
    [
        ("first-json", "prompt 0 continues the record before it, and there is none"),
        ("first-text", "prompt 0 continues the record before it, and there is none"),
        ("missing", "--continue-from {tmp}/gone.mp4 does not exist (or is not a file)"),
        ("corrupt-mp4", "--continue-from {tmp}/bad.mp4 could not be read as a video: "),
        ("corrupt-latents", "--continue-from: latents file {tmp}/bad.pt could not be read"),
        ("two-latents", "--continue-from {tmp}/two.pt holds the latents of 2 videos; it continues one"),
        ("with-image", "--image and --continue-from both give the first frame: pass one of them"),
        (
            "other-size",
            "--continue-from {tmp}/small.pt is 32x48 pixels (HxW) and the videos continuing it 64x64",
        ),
    ],
)
def test_bad_input_is_refused_before_any_work(case, message, nothing_loads, run_cli, tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    (tmp_path / "bad.pt").write_bytes(b"not latents")
    torch.save(torch.zeros(2, 48, 2, 4, 4), tmp_path / "two.pt")
    torch.save(torch.zeros(48, 2, 2, 3), tmp_path / "small.pt")
    (tmp_path / "first.json").write_text(json.dumps([{"prompt": "a", "continue": True}, "b"]))
    (tmp_path / "first.txt").write_text("+ a\nb\n")
    args = {
        "first-json": ["--prompts", tmp_path / "first.json"],
        "first-text": ["--prompts", tmp_path / "first.txt"],
        "missing": ["x", "--continue-from", tmp_path / "gone.mp4"],
        "corrupt-mp4": ["x", "--continue-from", tmp_path / "bad.mp4"],
        "corrupt-latents": ["x", "--continue-from", tmp_path / "bad.pt"],
        "two-latents": ["x", "--continue-from", tmp_path / "two.pt"],
        "with-image": ["x", "--continue-from", tmp_path / "two.pt", "--image", tmp_path / "bad.mp4"],
        "other-size": ["x", "--continue-from", tmp_path / "small.pt"],
    }[case]
    out = tmp_path / "out"
    out.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    res = run_cli("generate", *args, "--model", tmp_path, *CLI_SMALL, "-o", out)
    assert res.exit_code == 2, res.stderr
    (error,) = _errors(res.stderr)
    assert error.startswith(f"Error: {message.format(tmp=tmp_path)}") or message in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not list(out.iterdir())


def test_generate_file_continues_from_a_video(tiny_pan2, tmp_path):
    """The Python API runs rounds as the command does."""
    from pan2cli.config import RuntimeConfig

    generator = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))
    first = generator.generate(
        "a cat", preset="pan2-5s", steps=1, frames=5, height=64, width=64, output=tmp_path / "a.mp4"
    )
    prompts, out = _write_rounds(tmp_path, ["it sits", {"prompt": "it sleeps", "continue": True}])
    outcome = generator.generate_file(
        prompts,
        output=out,
        preset="pan2-5s",
        continue_from=tmp_path / "a.mp4",
        steps=1,
        frames=5,
        height=64,
        width=64,
    )
    assert not outcome.failures and [r.stitched for r in outcome.results] == [
        None,
        out / "000_it-sits.chain.mp4",
    ]
    assert len(_mp4_frames(out / "000_it-sits.chain.mp4")) == len(first.frames) + 4 + 4
    with pytest.raises(InputError, match="does not exist"):
        generator.generate_file(prompts, output=out, continue_from=tmp_path / "gone.mp4")
