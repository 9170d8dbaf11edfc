"""`pan2 generate` and `VideoGenerator` on CPU with a tiny release-shaped PAN 2 repository (scripts/make_tiny_pan2.py).

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
    """Records every transformer call's (hidden_states, timestep, encoder_hidden_states)."""

    def __init__(self, monkeypatch):
        from pan2cli.dit.model import PAN2Transformer3DModel

        self.calls = []
        real = PAN2Transformer3DModel.forward

        def spy(model, hidden_states, timestep, encoder_hidden_states):
            self.calls.append((hidden_states.clone(), timestep.clone(), encoder_hidden_states.clone()))
            return real(model, hidden_states, timestep, encoder_hidden_states)

        monkeypatch.setattr(PAN2Transformer3DModel, "forward", spy)


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
        and side["overrides"]["steps"] == 2
    )
    assert {"text_encoding", "denoising", "decode"} <= set(side["seconds"])
    assert side["attention"] == "cpu"  # the SDPA backend of the denoising: torch's own choice on the CPU


def test_sampler_is_the_release_flow_matching_euler_with_cfg(tiny_pan2, generator):
    """Seeded CPU noise, shifted sigmas, σ·1000 timesteps, u + g·(c − u), Euler: diffusers' scheduler as the oracle."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from pan2cli.dit import PAN2Transformer3DModel
    from pan2cli.pipeline.text import PAN2TextEncoder

    steps, guidance, seed = 3, 3.5, 11
    got = generator.generate(
        "a red fox", negative_prompt="snow", seed=seed, guidance=guidance, **{**SMALL, "steps": steps}
    ).latents

    encoder = PAN2TextEncoder.load(
        tiny_pan2 / "text_encoder", tiny_pan2 / "tokenizer", dtype=torch.float32, device=torch.device("cpu")
    )
    cond, uncond = encoder.encode("a red fox").features, encoder.encode("snow").features
    model = PAN2Transformer3DModel.from_pretrained(
        tiny_pan2, subfolder="transformer", torch_dtype=torch.float32
    )
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_pan2, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    latents = torch.randn(
        (1, 48, 2, 4, 6), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32
    )
    condition = torch.zeros(1, 49, 2, 4, 6)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = torch.cat([latents, condition], dim=1)
            c = model(x, t.expand(1), cond)
            u = model(x, t.expand(1), uncond)
            latents = scheduler.step(u + guidance * (c - u), t, latents).prev_sample
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


@pytest.mark.gpu
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
    assert "Error: 001_dog-run failed: simulated failure" in res.stderr
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
    without loading a model: durations whose frame counts differ when rounded up or down (issue 18)."""
    from pan2cli.config import settings_with
    from pan2cli.presets import load_preset

    preset = load_preset("pan2-5s")
    assert preset.fps == 24
    settings = settings_with(preset, {"prompt": "a cat", "duration": duration, "fps": fps})
    assert settings.frames == frames and settings.fps == (fps or 24.0)
