"""The denoising loop (pan2cli.pipeline.sampling) split over gloo ranks equals one process (float64):
CFG-parallel, Ulysses sequence parallelism (pan2cli.dit.parallel), and both together; and the initial noise,
drawn as IFM's vLLM-Omni runner draws it (a float32 generator on the model's device, or the one
`--generator-device` names), the same on every rank of a split video."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pan2cli.config import GenerationSettings, RuntimeConfig
from pan2cli.devices import resolve_generator_device
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.dit.parallel import SequenceParallel, token_sizes
from pan2cli.errors import InputError
from pan2cli.pipeline.conditioning import condition_latents
from pan2cli.pipeline.generator import VideoGenerator
from pan2cli.pipeline.sampling import denoise, initial_noise, split_ranks
from pan2cli.scheduler import SchedulerConfig, flow_sigmas
from pan2cli.testing.tiny_pan2 import TEXT_HIDDEN, tiny_transformer  # the release-shaped tiny transformer

SHAPE = (1, 48, 3, 4, 6)  # latent [1, 48, T, h, w]: 3 x 2 x 3 = 18 video tokens, uneven over 4 ranks
STEPS, GUIDANCE, SHIFT = 2, 2.5, 9.0
# 12 heads: they divide over 2, 3 and 4 ranks (the release's 32 over 2, 4 and 8)
TWELVE_HEADS = dict(
    num_attention_heads=12,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=TEXT_HIDDEN,
    rope_axes_dim=(4, 6, 6),
)


def _model(heads: int) -> PAN2Transformer3DModel:
    """float64, random and away from zero everywhere (the same in every process); counts its forward passes."""
    if heads == 2:
        model = tiny_transformer(seed=2).double()
    else:
        torch.manual_seed(4)
        model = PAN2Transformer3DModel(**TWELVE_HEADS).double().eval()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(
                    torch.randn_like(param) * (0.3 if param.dim() >= 2 else 0.1)
                    + (1.0 if param.dim() == 1 else 0.0)
                )
    model.calls = 0
    real = model.forward_passes  # `forward` goes through it too

    def forward_passes(hidden_states, timestep, texts):
        model.calls += len(texts)
        return real(hidden_states, timestep, texts)

    model.forward_passes = forward_passes
    return model


def _inputs():
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(SHAPE, generator=gen, dtype=torch.float32)
    cond = torch.randn(1, 7, TEXT_HIDDEN, generator=gen, dtype=torch.float64)
    uncond = torch.randn(
        1, 3, TEXT_HIDDEN, generator=gen, dtype=torch.float64
    )  # another length, as a negative prompt has
    return latents, condition_latents(SHAPE).to(torch.float64), cond, uncond


def _run(heads: int, guidance: float, split: bool, cfg_parallel: bool = True) -> tuple[torch.Tensor, int]:
    model = _model(heads)
    latents, condition, cond, uncond = _inputs()
    with torch.inference_mode():
        out = denoise(
            model,
            latents,
            condition,
            cond,
            uncond,
            flow_sigmas(STEPS, SHIFT).tolist(),
            guidance,
            1000,
            split=split,
            cfg_parallel=cfg_parallel,
        )
    return out, model.calls


def _rank(
    rank: int, world: int, init_file: str, out_prefix: str, heads: int, guidance: float, cfg_parallel: bool
) -> None:
    torch.set_num_threads(1)  # the ranks share the CI machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out, calls = _run(heads, guidance, split=True, cfg_parallel=cfg_parallel)
        torch.save({"latents": out, "calls": calls}, f"{out_prefix}{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, heads, guidance, cfg_parallel",
    [
        (2, 2, GUIDANCE, True),  # CFG-parallel: one pass per rank
        (3, 12, GUIDANCE, True),  # CFG over [0] and [1, 2], sequence-parallel in the second half
        (4, 12, GUIDANCE, True),  # CFG over [0, 1] and [2, 3], sequence-parallel in each (9 tokens each side)
        (3, 12, 1.0, True),  # no guidance: the sequence over all three ranks (6 tokens each)
        (4, 12, 1.0, True),  # 18 tokens over 4 ranks: bands of 5, 5, 4, 4
        (2, 12, GUIDANCE, False),  # both passes sequence-parallel over both ranks (SP measured alone)
    ],
    ids=["2-cfg", "3-cfg+sp", "4-cfg+sp", "3-sp", "4-sp-uneven", "2-sp-both-passes"],
)
def test_split_denoise_equals_one_process_float64(tmp_path, world, heads, guidance, cfg_parallel):
    """Every rank ends with one process's latents (float64 model: measured difference 0 in all six,
    bound 1e-9 as the issue states), and with CFG-parallel each rank runs one pass per step instead of two."""
    expected, calls = _run(heads, guidance, split=False)
    passes = 2 if guidance > 1 else 1
    assert calls == passes * STEPS
    prefix = str(tmp_path / "rank")
    mp.spawn(
        _rank,
        args=(world, str(tmp_path / "init"), prefix, heads, guidance, cfg_parallel),
        nprocs=world,
        join=True,
    )
    for rank in range(world):
        got = torch.load(f"{prefix}{rank}.pt", weights_only=True)
        assert got["calls"] == (STEPS if cfg_parallel else passes * STEPS)
        assert (got["latents"] - expected).abs().max().item() <= 1e-9


def test_guidance_uses_both_passes():
    """The unconditional pass matters (a split that dropped it would otherwise go unnoticed)."""
    with_cfg, _ = _run(2, GUIDANCE, split=False)
    cond_only, _ = _run(2, 1.0, split=False)
    assert (with_cfg - cond_only).abs().max().item() > 1e-3


def test_split_plan():
    assert split_ranks(1, 2) == [[0]]
    assert split_ranks(2, 2) == [[0], [1]]
    assert split_ranks(3, 2) == [[0], [1, 2]]
    assert split_ranks(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_ranks(4, 1) == [[0, 1, 2, 3]]
    assert token_sizes(18, 4) == [5, 5, 4, 4] and token_sizes(26598, 8) == [3325] * 6 + [3324] * 2


def _heads_check(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        with pytest.raises(InputError, match="needs a multiple of 3 heads, the model has 32"):
            SequenceParallel().check_heads(32)
        # check_heads sends nothing: without this, a fast rank could close its sockets while a slow one is
        # still connecting its gloo mesh ("Connection closed by peer" on a loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_heads_that_do_not_divide_are_refused(tmp_path):
    mp.spawn(_heads_check, args=(3, str(tmp_path / "init")), nprocs=3, join=True)


# -- the initial noise ------------------------------------------------------------------------------------------

NOISE_SHAPE = (1, 48, 2, 4, 6)
CPU = torch.device("cpu")


def _cpu_randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)


def test_cpu_noise_is_randn_of_a_cpu_generator_bit_for_bit():
    for seed in (0, 123, 2**64 - 1):
        got = initial_noise(NOISE_SHAPE, seed, CPU, CPU)
        assert got.dtype == torch.float32 and got.shape == NOISE_SHAPE
        assert torch.equal(got, _cpu_randn(NOISE_SHAPE, seed))
    assert not torch.equal(initial_noise(NOISE_SHAPE, 7, CPU, CPU), initial_noise(NOISE_SHAPE, 8, CPU, CPU))


class _StillModel:
    """A DiT whose velocity is 0: the sample is the initial noise itself."""

    config = SimpleNamespace(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16)

    def __call__(self, hidden_states, timestep, encoder_hidden_states):
        return torch.zeros_like(hidden_states[:, :48])


def _sample_noise(config: RuntimeConfig, seed: int) -> torch.Tensor:
    """`VideoGenerator.sample`'s initial noise (5 frames of 32x32: latents [1, 48, 2, 2, 2]), on the host."""
    generator = VideoGenerator(SimpleNamespace(transformer_arguments={}, scheduler=SchedulerConfig()), config)
    settings = GenerationSettings(
        prompt="p", negative_prompt="", seed=seed, frames=5, height=32, width=32, fps=24, steps=2, guidance=1.0,
        flow_shift=9.0, sampler="euler",
    )  # fmt: skip
    text = torch.zeros(1, 3, 8, device=generator.device)
    return generator.sample(_StillModel(), settings, text, None)


def test_a_cpu_run_draws_its_noise_on_the_cpu():
    """The model's device by default (here the CPU); `generator_device="cpu"` the same."""
    for config in (RuntimeConfig(device="cpu"), RuntimeConfig(device="cpu", generator_device="cpu")):
        assert torch.equal(_sample_noise(config, 5), _cpu_randn((1, 48, 2, 2, 2), 5))


def test_the_noise_is_drawn_where_generator_device_says_not_where_the_model_runs(monkeypatch):
    """`--generator-device cpu` for a model on another device (a GPU; the meta device stands for it on any host):
    the generator is made and draws on the CPU, the CPU draw of the seed, which then moves to the model's device. A
    generator made on the model's device would draw other numbers (and the seed would not give the reference video)."""
    generators, draws = [], []
    real_generator, real_randn = torch.Generator, torch.randn

    def generator(device="cpu"):
        generators.append(torch.device(device))
        return real_generator(device=device)

    def randn(*args, **kwargs):
        draws.append(real_randn(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setattr(torch, "randn", randn)
    noise = initial_noise((1, 48, 2, 2, 2), 5, CPU, torch.device("meta"))
    assert generators == [CPU] and noise.device.type == "meta"
    (drawn,) = draws
    assert drawn.device == CPU and torch.equal(drawn, _cpu_randn((1, 48, 2, 2, 2), 5))


def test_generator_device_rules(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert resolve_generator_device(None, CPU) == CPU and resolve_generator_device(None, cuda) == cuda
    assert resolve_generator_device("cpu", cuda) == CPU
    with pytest.raises(InputError, match="'generator_device' = 'gpu': must be one of: cpu, cuda"):
        RuntimeConfig(generator_device="gpu")
    assert RuntimeConfig().generator_device is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host
    with pytest.raises(
        InputError, match="--generator-device cuda: CUDA is not available on this machine"
    ) as err:
        RuntimeConfig(generator_device="cuda").torch_generator_device(CPU)
    assert "--generator-device cpu" in err.value.hint


def test_cli_generator_device_reaches_the_runtime_config(monkeypatch, run_cli, tmp_path):
    """Precedence: RuntimeConfig's default (None: the model's device) < --generator-device."""
    import pan2cli.pipeline.generator as generator_module

    seen = []

    def from_pretrained(model, *, config, **kwargs):
        seen.append(config)
        raise InputError("stopped before the checkpoint")

    monkeypatch.setattr(generator_module.VideoGenerator, "from_pretrained", from_pretrained)
    for extra, expected in (((), None), (("--generator-device", "cpu"), "cpu")):
        res = run_cli("generate", "a cat", "--device", "cpu", *extra, "-o", tmp_path / "x.mp4")
        assert res.exit_code == 2 and "stopped before the checkpoint" in res.stderr
        assert seen.pop().generator_device == expected


def test_cli_cuda_generator_without_cuda_is_bad_input_before_anything_loads(monkeypatch, run_cli, tmp_path):
    import pan2cli.pipeline.generator as generator_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(generator_module.VideoGenerator, "from_pretrained", None)  # never reached
    res = run_cli(
        "generate",
        "a cat",
        "--model",
        tmp_path / "none",
        "--generator-device",
        "cuda",
        "-o",
        tmp_path / "x.mp4",
    )
    assert res.exit_code == 2
    assert (
        res.stderr.splitlines()[0] == "Error: --generator-device cuda: CUDA is not available on this machine"
    )


def _noise_rank(rank: int, world: int, init_file: str, out_prefix: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        own = initial_noise(
            NOISE_SHAPE, 123, CPU, CPU
        )  # every rank draws with the same seed on the same device type
        shared = initial_noise(NOISE_SHAPE, 100 + rank, CPU, CPU, split=True)  # a split video: rank 0's
        torch.save({"own": own, "shared": shared}, f"{out_prefix}{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_rank_of_a_split_video_starts_from_the_same_noise(tmp_path):
    """Each rank's own draw is one process's; a split video takes rank 0's even where a rank would draw another
    (GPUs of different SM counts draw different CUDA noise for one seed)."""
    prefix = str(tmp_path / "rank")
    mp.spawn(_noise_rank, args=(2, str(tmp_path / "init"), prefix), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(f"{prefix}{rank}.pt", weights_only=True)
        assert torch.equal(got["own"], _cpu_randn(NOISE_SHAPE, 123))
        assert torch.equal(got["shared"], _cpu_randn(NOISE_SHAPE, 100))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_run_draws_its_noise_with_a_cuda_generator():
    """The release's draw on a GPU, pinned: randn of a CUDA generator on the GPU (a shape past one grid of the
    CUDA generator, where the thread layout matters); `--generator-device cpu` gives the CPU draw instead."""
    cuda = torch.device("cuda")
    shape, seed = (1, 48, 5, 44, 78), 123
    expected = torch.randn(
        shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda", dtype=torch.float32
    )
    got = initial_noise(shape, seed, cuda, cuda)
    assert got.device.type == "cuda" and got.dtype == torch.float32 and torch.equal(got, expected)
    on_cpu = initial_noise(shape, seed, CPU, cuda)
    assert on_cpu.device.type == "cuda" and torch.equal(on_cpu.cpu(), _cpu_randn(shape, seed))
    assert not torch.equal(on_cpu, expected)
    # the whole path of a GPU run: the sample (still velocity) is the CUDA draw; with "cpu", the CPU one
    small = (1, 48, 2, 2, 2)
    cuda_draw = torch.randn(
        small, generator=torch.Generator("cuda").manual_seed(5), device="cuda", dtype=torch.float32
    )
    assert torch.equal(_sample_noise(RuntimeConfig(device="cuda"), 5), cuda_draw.cpu())
    assert torch.equal(
        _sample_noise(RuntimeConfig(device="cuda", generator_device="cpu"), 5), _cpu_randn(small, 5)
    )
