"""`pan2 generate` and `VideoGenerator` on CPU with a tiny release-shaped PAN 2 repository (`pan2cli.testing.tiny_pan2`).

The sampler is checked against diffusers' FlowMatchEulerDiscreteScheduler (the release's scheduler, used here
as an oracle only), the image conditioning against the release's recipe written out step by step.
"""

from __future__ import annotations

import json
import shutil

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from pan2cli.config import RuntimeConfig
from pan2cli.errors import InputError
from pan2cli.latents import normalize
from pan2cli.pipeline import VideoGenerator
from pan2cli.vae.checkpoint import load_vae_encoder
from tests.pipeline.diffusers_reference import diffusers_latents

SMALL = dict(preset="pan2-5s", steps=2, frames=5, height=64, width=96)
CLI_SMALL = ("--steps", 2, "--frames", 5, "--size", "64x96", "--device", "cpu")


def _mp4_frames(path) -> np.ndarray:
    """Decode an MP4 with the bundled ffmpeg: (F, H, W, 3) uint8."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


@pytest.fixture(scope="module")
def generator(tiny_pan2):
    return VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))


@pytest.fixture(scope="module")
def start_image(tmp_path_factory):
    """A 104x120 RGB picture whose channels and positions can be told apart (cover-resized to 83x96, cropped to 64x96)."""
    y, x = np.mgrid[0:104, 0:120]
    img = np.stack([(2 * x) % 256, (3 * y) % 256, (x * y) % 251], axis=-1).astype(np.uint8)
    path = tmp_path_factory.mktemp("img") / "start.png"
    iio.imwrite(path, img)
    return path


class _Spy:
    """Records every pass of the transformer (hidden_states, timestep, encoder_hidden_states): `forward` runs
    one through `forward_passes`, guidance two in one call."""

    def __init__(self, monkeypatch):
        from pan2cli.dit.model import PAN2Transformer3DModel

        self.calls = []
        real = PAN2Transformer3DModel.forward_passes

        def spy(model, hidden_states, timestep, texts):
            for text in texts:
                self.calls.append((hidden_states.clone(), timestep.clone(), text.clone()))
            return real(model, hidden_states, timestep, texts)

        monkeypatch.setattr(PAN2Transformer3DModel, "forward_passes", spy)


def test_cli_writes_mp4_and_sidecar(tiny_pan2, run_cli, tmp_path):
    out = tmp_path / "x.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--fps", 12, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert _mp4_frames(out).shape == (5, 64, 96, 3)
    import imageio

    reader = imageio.get_reader(out, "ffmpeg")
    try:
        assert reader.get_meta_data()["fps"] == 12
    finally:
        reader.close()
    side = json.loads((tmp_path / "x.json").read_text())
    assert (
        side["prompt"] == "a cat"
        and side["seed"] == 123
        and side["steps"] == 2
        and side["preset"] == "pan2-10s"
    )
    assert side["fps"] == 12.0 and side["dtype"] == "float32"  # --device cpu runs float32
    assert (
        side["model"] == str(tiny_pan2.resolve())
        and side["pan2cli_version"]
        and side["overrides"]["steps"] == {"value": 2, "from": "--steps"}
    )
    assert set(side["seconds"]) == {"text_encoding", "denoising", "decode", "write"}
    assert side["attention"] == "cpu"  # the SDPA backend of the denoising: torch's own choice on the CPU


def test_sampler_is_the_release_flow_matching_euler_with_cfg(tiny_pan2, generator):
    """Seeded CPU noise, shifted sigmas, σ·1000 timesteps, u + g·(c − u), Euler: diffusers' scheduler as the oracle."""
    steps, guidance, seed = 3, 3.5, 11
    got = generator.generate(
        "a red fox", negative_prompt="snow", seed=seed, guidance=guidance, **{**SMALL, "steps": steps}
    ).latents
    latents, _ = diffusers_latents(tiny_pan2, "a red fox", "snow", steps=steps, guidance=guidance, seed=seed)
    assert got.shape == latents.shape
    assert (got - latents).abs().max().item() <= 1e-4  # float32 sigmas in diffusers, float64 here


def test_seed_decides_the_frames(generator):
    a = generator.generate("a red fox", seed=7, **SMALL).frames
    b = generator.generate("a red fox", seed=7, **SMALL).frames
    c = generator.generate("a red fox", seed=8, **SMALL).frames
    assert a.shape == (5, 64, 96, 3) and a.dtype == torch.uint8
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_text_to_video_condition_is_zero_and_guidance_one_skips_the_negative(generator, monkeypatch):
    spy = _Spy(monkeypatch)
    one = generator.generate("a dog", guidance=1.0, negative_prompt="snow", **SMALL)
    assert len(spy.calls) == 2  # one pass per step: no unconditional pass
    for hidden, timestep, _ in spy.calls:
        assert hidden.shape == (1, 97, 2, 4, 6) and not hidden[:, 48:].any()  # no condition, no mask
        assert timestep.shape == (1,)
    assert [round(c[1].item(), 3) for c in spy.calls] == [1000.0, round(1000 * 9 * 0.5 / (1 + 8 * 0.5), 3)]
    other = generator.generate("a dog", guidance=0.5, negative_prompt="the city at night", **SMALL)
    assert len(spy.calls) == 4  # g ≤ 1: the release skips guidance
    assert torch.equal(one.latents, other.latents)
    guided = generator.generate("a dog", guidance=2.5, negative_prompt="snow", **SMALL)
    assert len(spy.calls) == 4 + 4
    assert not torch.equal(spy.calls[-1][2], spy.calls[-2][2])  # prompt and negative prompt differ
    assert not torch.equal(one.latents, guided.latents)


def test_offload_gives_the_same_frames(tiny_pan2, generator):
    offloaded = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu", offload=True))
    a = generator.generate("the door opens", **SMALL)
    b = offloaded.generate("the door opens", **SMALL)
    # Same weights, same ops; the streamed copies can round a GEMV's last bit differently on CPU.
    assert torch.allclose(a.latents, b.latents, rtol=0, atol=1e-5)
    assert (a.frames.int() - b.frames.int()).abs().max().item() <= 1


# Its memory plan reads the GPU's free memory: it runs in the group, never beside a 76 GiB decode test.
@pytest.mark.gpu
@pytest.mark.xdist_group("full-size-gpu-memory")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_on_cuda_gives_the_same_latents(tiny_pan2):
    """`--offload` on a GPU: the blocks stream from pinned host memory to the GPU one after another, and the
    sample is the one of the resident model (the same bf16 kernels on the same weights: equal to the bit)."""
    resident = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cuda"))
    streamed = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cuda", offload=True))
    a = resident.generate("the door opens", **SMALL)
    b = streamed.generate("the door opens", **SMALL)
    assert torch.equal(a.latents, b.latents)


def test_cli_offload_and_image_to_video_end_to_end(tiny_pan2, generator, start_image, run_cli, tmp_path):
    out = tmp_path / "door.mp4"
    res = run_cli(
        "generate",
        "the door opens",
        "--model",
        tiny_pan2,
        *CLI_SMALL,
        "--image",
        start_image,
        "--offload",
        "--save-latents",
        "-o",
        out,
    )
    assert res.exit_code == 0, res.stderr
    assert _mp4_frames(out).shape == (5, 64, 96, 3)
    # --offload on the CPU runs (the same frames) but changes nothing there, and one line says so
    warnings = [line for line in res.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("Warning: --offload changes nothing on the CPU"), (
        res.stderr
    )
    side = json.loads((tmp_path / "door.json").read_text())
    assert side["image"] == str(start_image) and side["config"]["offload"] is True
    saved = torch.load(tmp_path / "door.latents.pt", weights_only=True)["latents"]
    in_memory = generator.generate("the door opens", image=start_image, **SMALL).latents[0]
    assert torch.allclose(saved, in_memory, rtol=0, atol=1e-5)  # streamed weights: the same latents


def test_image_to_video_conditions_frame_0_with_the_release_recipe(
    tiny_pan2, generator, start_image, monkeypatch
):
    """Cover-resize 104x120 → 83x96 (LANCZOS), crop rows round(19/2) = 10 (half to even) … 74, /255·2 − 1,
    the VAE posterior's mode normalised, on condition frame 0 with mask 1 there; frame 0 itself still noised."""
    from PIL import Image

    spy = _Spy(monkeypatch)
    res = generator.generate("the door opens", image=start_image, guidance=1.0, **SMALL)
    with Image.open(start_image) as image:
        resized = np.asarray(image.convert("RGB").resize((96, 83), resample=Image.LANCZOS))
    crop = resized[10:74, 0:96].astype(np.float32)  # rows 10…73, RGB order kept
    pixels = torch.from_numpy(crop).permute(2, 0, 1) / 255.0 * 2.0 - 1.0
    encoder = load_vae_encoder(tiny_pan2 / "vae")
    expected = normalize(
        encoder.encode(pixels[None, :, None]).float(), encoder.config.latents_mean, encoder.config.latents_std
    )
    for hidden, _, _ in spy.calls:
        assert torch.allclose(hidden[:, 48:96, :1], expected, atol=1e-5)
        assert not hidden[:, 48:96, 1:].any()
        assert (hidden[:, 96, 0] == 1).all() and not hidden[:, 96, 1:].any()
    assert not torch.equal(spy.calls[0][0][:, :48, :1], expected)  # the noisy frame 0 is not replaced
    assert not torch.allclose(res.latents[:, :, :1], expected, atol=1e-2)
    plain = generator.generate("the door opens", guidance=1.0, **SMALL)
    assert not torch.equal(plain.latents, res.latents)


def test_save_latents_round_trip_through_pan2_decode(tiny_pan2, generator, run_cli, tmp_path):
    out = tmp_path / "v.mp4"
    res = run_cli("generate", "a cat runs", "--model", tiny_pan2, *CLI_SMALL, "--save-latents", "-o", out)
    assert res.exit_code == 0, res.stderr
    latents = tmp_path / "v.latents.pt"
    data = torch.load(latents, weights_only=True)
    assert (
        data["latents"].shape == (48, 2, 4, 6)
        and data["latents"].dtype == torch.float32
        and data["fps"] == 24.0
    )
    again = generator.generate("a cat runs", **SMALL)
    assert torch.equal(data["latents"], again.latents[0])
    dec = run_cli("decode", latents, "--vae", tiny_pan2 / "vae", "--device", "cpu", "-o", tmp_path / "d.pt")
    assert dec.exit_code == 0, dec.stderr
    assert torch.equal(torch.load(tmp_path / "d.pt", weights_only=True), again.frames)


def test_a_long_prompt_is_cut_with_a_warning_quiet_or_not(tiny_pan2, run_cli, tmp_path):
    prompt = " ".join(["the red fox runs over the snow"] * 300)  # well over 1536 tokens after the header
    res = run_cli(
        "generate", prompt, "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "-q", "-o", tmp_path / "long.mp4"
    )
    assert res.exit_code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and "tokens were cut" in warnings[0] and "1536" in warnings[0], res.stderr


def test_prompt_file_batch_skip_existing_and_failures(tiny_pan2, run_cli, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": [
        {"prompt": "a cat jumps", "seed": 1},
        {"prompt": "a dog runs", "name": "Dog Run", "negative_prompt": {"visual": ["blurry", "dark"], "motion": "jitter"}, "camera": "pan"},
        "the fox in the snow",
    ]}))  # fmt: skip
    out = tmp_path / "videos"
    out.mkdir()
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    names = sorted(p.name for p in out.glob("*.mp4"))
    assert names == ["000_a-cat-jumps.mp4", "001_dog-run.mp4", "002_the-fox-in-the-snow.mp4"]
    assert "ignoring unknown field(s) camera" in res.stderr
    side = json.loads((out / "001_dog-run.json").read_text())
    assert side["negative_prompt"] == "visual: blurry, dark; motion: jitter" and side["name"] == "Dog Run"

    # resume: only the missing one is made again, its leftover sidecar replaced without --overwrite
    (out / "001_dog-run.mp4").unlink()
    (out / "001_dog-run.json").write_text("{}")
    before = (out / "000_a-cat-jumps.mp4").stat().st_mtime_ns
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out, "--skip-existing"
    )
    assert res.exit_code == 0, res.stderr
    assert res.stdout.split() == [str(out / "001_dog-run.mp4")]
    assert (out / "000_a-cat-jumps.mp4").stat().st_mtime_ns == before
    assert json.loads((out / "001_dog-run.json").read_text())["name"] == "Dog Run"

    # a failing prompt is reported, the others are made, exit 1 with a summary
    from pan2cli.pipeline.generator import VideoGenerator as G

    real = G.sample

    def failing(self, model, settings, *args, **kwargs):
        if "dog" in settings.prompt:
            raise InputError("simulated failure")
        return real(self, model, settings, *args, **kwargs)

    monkeypatch.setattr(G, "sample", failing)
    again = tmp_path / "again"
    again.mkdir()
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", again)
    assert res.exit_code == 1
    assert f"Error: {prompts}: prompt 1 (001_dog-run) failed: simulated failure" in res.stderr
    assert "1 prompt(s) failed" in res.stderr
    assert sorted(p.name for p in again.glob("*.mp4")) == [
        "000_a-cat-jumps.mp4",
        "002_the-fox-in-the-snow.mp4",
    ]


def test_plain_text_prompt_file(tiny_pan2, run_cli, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("# comment\na cat\n\nthe dog\n")
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "-o", tmp_path
    )
    assert res.exit_code == 0, res.stderr
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["000_a-cat.mp4", "001_the-dog.mp4"]


def _broken_repo(tiny_pan2, tmp_path, case):
    """A copy of the tiny repository with one thing wrong."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "broken"
    shutil.copytree(
        tiny_pan2, model, ignore=shutil.ignore_patterns("vae") if case == "missing component" else None
    )
    config_path = model / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    if case == "another model's transformer":
        config_path.write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": 30}))
    elif case == "unknown config key":
        config_path.write_text(json.dumps({**config, "hidden_size": 5120}))
    elif case.startswith(("missing key", "unexpected key", "wrong shape")):
        shard = sorted((model / "transformer").glob("*.safetensors"))[-1]
        state = load_file(shard)
        if case == "missing key":
            state.pop("proj_out.weight")
        elif case == "unexpected key":
            state["proj_out.extra"] = torch.zeros(3)
        else:
            state["proj_out.bias"] = torch.zeros(7)
        save_file(state, str(shard))
        index_path = next((model / "transformer").glob("*.index.json"))
        index = json.loads(index_path.read_text())
        index["weight_map"] = {
            k: shard.name if k in state else v
            for k, v in index["weight_map"].items()
            if k in state or v != shard.name
        }
        index_path.write_text(json.dumps(index))
    elif case == "tokenizer without a chat template":
        for name in ("tokenizer_config.json",):
            path = model / "tokenizer" / name
            data = json.loads(path.read_text())
            data.pop("chat_template", None)
            path.write_text(json.dumps(data))
        for path in (model / "tokenizer").glob("chat_template*"):
            path.unlink()
    return model


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing component", "vae/"),
        ("another model's transformer", "WanTransformer3DModel"),
        ("unknown config key", "hidden_size"),
        ("missing key", "missing keys: proj_out.weight"),
        ("unexpected key", "unexpected keys: proj_out.extra"),
        ("wrong shape", "proj_out.bias [7] (expected [192])"),
        ("tokenizer without a chat template", "chat template"),
        ("empty prompt", "prompt is empty"),
        ("unreadable image", "could not be read as an image"),
        (
            "1x1 start image",
            "is 1x1 pixels: a start image needs at least 16x16",
        ),  # once taken without a word
        ("frames not 1 mod 4", "must be 1 + 4*k"),
        ("size not multiple of 32", "multiple of 32"),
    ],
)
def test_bad_input_exits_2_with_one_error_line_and_no_file(case, message, tiny_pan2, run_cli, tmp_path):
    model, args = tiny_pan2, ["a cat"]
    if case in (
        "missing component",
        "another model's transformer",
        "unknown config key",
        "missing key",
        "unexpected key",
        "wrong shape",
        "tokenizer without a chat template",
    ):
        model = _broken_repo(tiny_pan2, tmp_path, case)
    elif case == "empty prompt":
        args = [""]
    elif case == "unreadable image":
        bad = tmp_path / "bad.png"
        bad.write_text("not an image")
        args += ["--image", bad]
    elif case == "1x1 start image":
        dot = tmp_path / "dot.png"
        iio.imwrite(dot, np.zeros((1, 1, 3), np.uint8))
        args += ["--image", dot]
    out = tmp_path / "x.mp4"
    small = list(CLI_SMALL)
    if case == "frames not 1 mod 4":
        small[small.index("--frames") + 1] = 6
    if case == "size not multiple of 32":
        small[small.index("--size") + 1] = "60x96"
    res = run_cli("generate", *args, "--model", model, *small, "-o", out)
    assert res.exit_code == 2, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and message in errors[0], res.stderr
    assert not out.exists() and not (tmp_path / "x.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.mp4")]


def test_output_folder_with_a_trailing_slash_must_exist(tiny_pan2, run_cli, tmp_path):
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", f"{tmp_path}/clips/")
    assert res.exit_code == 2 and "the folder does not exist" in res.stderr
    assert not (tmp_path / "clips").exists()
    (tmp_path / "clips").mkdir()
    res = run_cli(
        "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "-o", f"{tmp_path}/clips/"
    )
    assert res.exit_code == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "clips" / "a-cat.mp4")


@pytest.mark.parametrize("duration, frames", [(0.52, 5), (0.64, 9)])
def test_duration_rounds_to_the_nearest_frame_count(generator, duration, frames):
    """frames = 4·round(duration·fps/4) + 1: 5.2/4 = 1.3 → 1 (not up to 2), 6.4/4 = 1.6 → 2 (not down to 1)."""
    res = generator.generate(
        "a cat", preset="pan2-5s", steps=1, duration=duration, fps=10, height=64, width=96
    )
    assert res.frames.shape[0] == frames


@pytest.mark.parametrize(
    ("duration", "fps", "frames"),
    [
        (5.05, None, 121),  # 24 fps: 121.2/4 = 30.3 → 30 → 121 (rounded up: 31 → 125)
        (4.95, None, 121),  # 118.8/4 = 29.7 → 30 → 121 (rounded down: 29 → 117)
        (10.05, None, 241),  # 241.2/4 = 60.3 → 60 → 241 (rounded up: 245)
        (0.3, 10.0, 5),  # 3/4 = 0.75 → 1 → 5
        (0.1, 10.0, 1),  # 1/4 = 0.25 → 0 → 1 frame (rounded up: 5)
    ],
)
def test_duration_sets_the_nearest_1_plus_4k_frames(duration, fps, frames):
    """`--duration` (and a prompt record's duration) → 4·round(duration·fps/4) + 1 at the preset's or the given fps,
    without loading a model: durations whose frame counts differ when rounded up or down."""
    from pan2cli.config import settings_with
    from pan2cli.presets import load_preset

    preset = load_preset("pan2-5s")
    assert preset.fps == 24
    settings = settings_with(preset, {"prompt": "a cat", "duration": duration, "fps": fps})
    assert settings.frames == frames and settings.fps == (fps or 24.0)


# What a new user hit with `pan2 generate`, and the options whose values no test followed.


def test_bad_records_are_reported_with_file_and_number_and_the_others_run(tiny_pan2, run_cli, tmp_path):
    """One unreadable `image` (or any bad record) stopped the whole batch before it started, named as `--image`, a
    flag the user never passed. Each bad record is now reported with the file and its number, the good ones are
    made, exit 1 at the end. The file is JSON Lines: one record per line, one of them no JSON."""
    (tmp_path / "corrupt.png").write_text("not an image")
    prompts = tmp_path / "midfail.jsonl"
    prompts.write_text(
        '"ok one"\n{"prompt": "bad img", "image": "corrupt.png"}\n{not json\n\n5\n{"prompt": "ok two", "seed": 4}\n'
    )
    out = tmp_path / "out"
    out.mkdir()
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "-o", out)
    assert res.exit_code == 1, res.stderr
    assert sorted(p.name for p in out.glob("*.mp4")) == ["000_ok-one.mp4", "004_ok-two.mp4"]
    assert json.loads((out / "004_ok-two.json").read_text())["seed"] == 4
    # the records the file itself rules out, then the one whose image fails its check, then the summary
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert errors[0].startswith(
        f"Error: {prompts}: prompt 2 (line 3) is not valid JSON: Expecting property name"
    )
    assert (
        errors[1]
        == f"Error: {prompts}: prompt 3 (line 5) is an integer (5); expected a string or an object with 'prompt'"
    )
    assert errors[2].startswith(
        f"Error: {prompts}: prompt 1 (001_bad-img): 'image' {tmp_path / 'corrupt.png'} could not be read as an image"
    )
    assert errors[3] == "Error: 3 prompt(s) failed (see above)"
    assert len(errors) == 4 and "--image" not in res.stderr
    assert "2 video(s) written, 0 skipped, 3 failed." in res.stderr


def test_prompt_file_formats(tmp_path):
    """`.jsonl` files once failed with "Extra data" and no hint. JSON Lines by suffix (`.jsonl`, `.ndjson`), or
    when a JSON-looking file holds one value per line; JSON by `.json` or a leading `[`/`{`; plain text else."""
    from pan2cli.pipeline.prompts import read_prompt_file

    def prompts(name: str, text: str) -> list[str]:
        path = tmp_path / name
        path.write_text(text)
        records, _ = read_prompt_file(path)
        return [r.prompt if r.problem is None else f"! {r.problem}" for r in records]

    lines = '{"prompt": "a cat"}\n\n"a dog"\n'
    assert prompts("p.jsonl", lines) == prompts("p.ndjson", lines) == ["a cat", "a dog"]
    assert prompts("p.json", lines) == prompts("p.txt", lines) == ["a cat", "a dog"]  # one value per line
    assert prompts("one.jsonl", '{"prompt": "a cat"}\n') == [
        "a cat"
    ]  # one record, not a file of {"prompts": ...}
    assert prompts("p.json", '{"prompts": ["a cat", {"prompt": "a dog"}]}') == ["a cat", "a dog"]
    assert prompts("p.txt", "# a comment\na cat\n[not json] a dog\n") == ["a cat", "[not json] a dog"]
    assert prompts("p.jsonl", '"a cat"\n[1, 2]\ntrue\n') == [
        "a cat",
        f"! {tmp_path / 'p.jsonl'}: prompt 1 (line 2) is a list; expected a string or an object with 'prompt'",
        f"! {tmp_path / 'p.jsonl'}: prompt 2 (line 3) is a boolean (True); expected a string or an object with 'prompt'",
    ]
    with pytest.raises(InputError, match="is not valid JSON") as info:
        prompts("bad.json", '[{"prompt": "a cat"},\n')  # the whole file is one document: nothing to run
    assert ".jsonl" in info.value.hint


@pytest.mark.parametrize(
    ("prompt", "name"),
    [
        ("A cat, jumping!", "a-cat-jumping.mp4"),  # Latin slugs as before
        ("日本語の猫", "日本語の猫.mp4"),  # letters of every script are kept
        ("Café au lait", "café-au-lait.mp4"),
        # macOS types the accent decomposed (e + U+0301): the same name, so that --skip-existing finds the video
        ("Cafe\u0301 au lait", "café-au-lait.mp4"),
        ("ｆｕｌｌ　ｗｉｄｔｈ", "full-width.mp4"),  # NFKC: the compatibility forms too
    ],
)
def test_default_names_keep_the_words_of_the_prompt(prompt, name, tmp_path, monkeypatch):
    from pan2cli.pipeline.batch_plan import plan_jobs
    from pan2cli.presets import load_preset

    monkeypatch.chdir(tmp_path)
    (job,), *_ = plan_jobs(prompt, None, None, load_preset("pan2-5s"), {})
    assert job.output == tmp_path / name


def test_default_names_stay_distinct_for_any_prompt(tmp_path, monkeypatch):
    """Prompts without Latin letters once all defaulted to `video.mp4`, the second run failing with "already
    exists". A slug that is empty, or cut at 48 characters, ends in 8 hex digits of the prompt's SHA-256."""
    import re

    from pan2cli.pipeline.batch_plan import plan_jobs
    from pan2cli.presets import load_preset

    monkeypatch.chdir(tmp_path)
    long = "a cat walks along the old harbour wall at dawn while the gulls "
    prompts = ["日本語の猫", "日本語の犬", "!!!", "???", "🐱", long + "circle", long + "scream"]
    names = [
        plan_jobs(prompt, None, None, load_preset("pan2-5s"), {})[0][0].output.name for prompt in prompts
    ]
    assert len(set(names)) == len(prompts), names
    assert all(re.fullmatch(r"video-[0-9a-f]{8}\.mp4", name) for name in names[2:5]), names
    assert all(
        re.fullmatch(r"a-cat-walks-along-the-old-harbour-wall-[0-9a-f]{8}\.mp4", n) for n in names[5:]
    ), names


def test_sidecars_tell_what_ran(tiny_pan2, start_image, run_cli, tmp_path, monkeypatch):
    """A file preset by its absolute path (its stem is no preset `--preset` takes); overrides from the
    flags and the record, each with where it came from (the record's replacing `--frames`); the start image by its
    absolute path; the processes; the DiT kernels and decoder that ran (not `dit_fused_kernels: true` on the CPU);
    each video's own stage seconds, `write` included, and the loads shared by the batch said once, as shared."""
    from pan2cli.presets import load_preset, preset_to_toml

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.toml").write_text(preset_to_toml(load_preset("pan2-5s")))
    shutil.copy(start_image, tmp_path / "start.png")
    (tmp_path / "prompts.json").write_text(
        json.dumps([{"prompt": "the door opens", "image": "start.png", "seed": 7, "duration": 0.2}, "a cat"])
    )
    (tmp_path / "out").mkdir()
    res = run_cli(
        "generate", "--prompts", "prompts.json", "--model", tiny_pan2, "--preset", "my.toml", "--steps", 1,
        "--frames", 9, "--size", "64x96", "--device", "cpu", "--revision", "v1", "-o", "out",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    assert f"Warning: --revision v1 is ignored: --model {tiny_pan2} is a local path" in res.stderr
    door, cat = (
        json.loads((tmp_path / "out" / name).read_text())
        for name in ("000_the-door-opens.json", "001_a-cat.json")
    )
    assert door["preset"] == cat["preset"] == str(tmp_path / "my.toml")
    flags = {"steps": (1, "--steps"), "height": (64, "--size"), "width": (96, "--size")}
    record = {"seed": 7, "image": str(tmp_path / "start.png"), "duration": 0.2}
    assert door["overrides"] == {
        **{name: {"value": value, "from": source} for name, (value, source) in flags.items()},
        **{name: {"value": value, "from": "record"} for name, value in record.items()},
    }
    assert cat["overrides"] == {
        **{name: {"value": value, "from": source} for name, (value, source) in flags.items()},
        "frames": {"value": 9, "from": "--frames"},
    }
    assert (door["frames"], cat["frames"]) == (5, 9)  # 0.2 s at 24 fps
    assert door["image"] == str(tmp_path / "start.png") and door["prompts_file"] == str(
        tmp_path / "prompts.json"
    )
    assert door["processes"] == {"count": 1}
    assert door["ran"] == {
        "dit_fused_kernels": False,
        "decoder": "reference",
        "precision": "float32",  # the CPU runs the DiT in float32
        "fp8_attention": None,
    }
    assert (door["crf"], door["x264_preset"]) == (17, "faster")
    assert set(door["seconds"]) == {"text_encoding", "image_encoding", "denoising", "decode", "write"}
    assert set(cat["seconds"]) == {"text_encoding", "denoising", "decode", "write"}
    assert door["shared_loads"] == {
        **cat["shared_loads"],
        "load_vae_encoder": door["shared_loads"]["load_vae_encoder"],
    }
    assert {name: load["videos"] for name, load in door["shared_loads"].items()} == {
        "load_text_encoder": 2, "load_vae_encoder": 1, "load_transformer": 2, "load_vae_decoder": 2,
    }  # fmt: skip


def test_the_sidecar_names_the_split_over_processes(monkeypatch):
    """`processes` in the sidecar (`--gpus N`): a sharded batch names the rank that made the video; one video shared
    by the ranks names the guidance passes' halves, the sequence split of each and the decode's row split."""
    import pan2cli.pipeline.sidecar as sidecar
    from pan2cli.config import settings_with
    from pan2cli.presets import load_preset

    def ran(shared: bool) -> sidecar.BatchRan:
        return sidecar.BatchRan(
            config=RuntimeConfig(device="cpu"), precision="bf16", dit_fused_kernels=False, ranks_share_jobs=shared,
            decode_rows_split=shared, memory_plan=None, clock_start=0.0, clock_from="batch start",
        )  # fmt: skip

    monkeypatch.setattr(sidecar.distributed, "world_size", lambda: 4)
    monkeypatch.setattr(sidecar.distributed, "rank", lambda: 3)
    guided, unguided = (settings_with(load_preset("pan2-5s"), {"guidance": g}) for g in (2.5, 1.0))
    assert sidecar.processes(guided, ran(False), heads=4) == {"count": 4, "split": "prompts", "rank": 3}
    assert sidecar.processes(guided, ran(True), heads=4) == {
        "count": 4, "split": "one video", "cfg_parallel": True, "sequence_parallel": [2, 2], "decode_rows_split": True,
    }  # fmt: skip
    monkeypatch.setattr(sidecar.distributed, "world_size", lambda: 3)
    assert sidecar.processes(unguided, ran(True), heads=4)["sequence_parallel"] == [
        1
    ]  # 4 heads do not split over 3
    assert sidecar.processes(guided, ran(True), heads=4)["sequence_parallel"] == [1, 2]


def test_generate_crf_reaches_the_encoder(tiny_pan2, run_cli, tmp_path):
    """`--crf` reaches x264 (the bug: the default used instead): the same frames (same seed)
    make a larger file at 0 than at 35."""
    sizes = {}
    for crf in (0, 35):
        out = tmp_path / f"crf{crf}.mp4"
        res = run_cli(
            "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "--crf", crf, "-o", out
        )
        assert res.exit_code == 0, res.stderr
        sizes[crf] = out.stat().st_size
    assert sizes[0] > sizes[35], sizes


def test_generate_chunk_latent_frames_reaches_the_decoder(tiny_pan2, run_cli, tmp_path, writer_chunks):
    """`--chunk-latent-frames` reaches the decoder (the bug: the preset's 4 used instead): 4
    latent frames (13 video frames) in chunks of 2 after the first reach the writer as 1, 8 and 4 frames."""
    args = ("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "--frames", 13)
    res = run_cli(*args, "--chunk-latent-frames", 2, "-o", tmp_path / "two.mp4")
    assert res.exit_code == 0, res.stderr
    assert writer_chunks == [1, 8, 4]
    writer_chunks.clear()
    res = run_cli(*args, "-o", tmp_path / "preset.mp4")  # the preset's chunk, 4
    assert res.exit_code == 0, res.stderr
    assert writer_chunks == [1, 12]


def test_generate_quiet_prints_nothing_on_stderr(tiny_pan2, run_cli, tmp_path):
    """`-q` silences stderr (the bug: the option ignored, each video's line printed); the path
    written is still on stdout."""
    out = tmp_path / "q.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--steps", 1, "-q", "-o", out)
    assert res.exit_code == 0
    assert res.stderr == "" and res.stdout == f"{out}\n" and out.is_file()


def test_generate_revision_reaches_the_hub(run_cli, tmp_path, monkeypatch):
    """`--revision` reaches the hub (the bug: the main branch asked for instead). The hub's
    check records what it was asked and stops the run before any download."""
    import pan2cli.components.hub_check as hub_check
    from pan2cli.errors import DownloadError

    asked = []

    def hub_components(repo_id, revision=None):
        asked.append((repo_id, revision))
        raise DownloadError("stopped before any download")

    monkeypatch.setattr(hub_check, "hub_components", hub_components)
    res = run_cli(
        "generate",
        "a cat",
        "--model",
        "org/pan2-test",
        "--revision",
        "v1.2",
        "--device",
        "cpu",
        "-o",
        tmp_path / "x.mp4",
    )
    assert res.exit_code == 1 and "Error: stopped before any download" in res.stderr
    assert asked == [("org/pan2-test", "v1.2")]


def test_generate_output_on_stdout_is_refused_with_a_hint(tiny_pan2, run_cli):
    """`-o -` was once told "pan2 generate writes MP4 files (.mp4)"; pan2 writes files, and says so."""
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", "-")
    assert res.exit_code == 2
    assert res.stderr.splitlines()[0].startswith("Error: -o -: pan2 writes video to files, not to stdout")


_REPORT_MODULES = """
import atexit, os, sys
atexit.register(lambda: open(os.environ["PAN2_TEST_MODULES"], "w").write(
    " ".join(m for m in ("transformers", "diffusers", "accelerate") if m in sys.modules)))
"""


def test_generate_imports_neither_transformers_nor_diffusers(tiny_pan2, tmp_path):
    """Importing transformers took 6-8 s of the command's start on an H200 host; pan2 runs its own
    Qwen3.5 model and tokenizer, so `pan2 generate` never imports it (nor diffusers, an oracle only)."""
    import subprocess
    import sys

    from tests.subprocess_env import hooked_env

    report = tmp_path / "modules.txt"
    out = tmp_path / "cat.mp4"
    command = [sys.executable, "-m", "pan2cli", "generate", "a cat", "--model", str(tiny_pan2)]
    command += [str(a) for a in (*CLI_SMALL, "--steps", 1, "-q", "-o", out)]
    done = subprocess.run(
        command,
        env=hooked_env(tmp_path, _REPORT_MODULES, PAN2_TEST_MODULES=str(report)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert out.is_file() and report.read_text() == ""
