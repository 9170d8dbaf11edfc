"""Streaming layers from host memory (`pan2cli.pipeline.offload`, `pan2cli.pipeline.pinned`) and the walk of both
guidance passes through each block (`PAN2Transformer3DModel.forward_passes`).

On the CPU the "device" is the CPU too: a streamed layer's tensors are then copies of its host arena, so which
copy a tensor points at (the arena or not) tells what the streamer moved. The GPU tests run the same on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pan2cli.dit import set_fused_kernels
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.dit.quantize import quantize_transformer
from pan2cli.pipeline.memory_plan import spread
from pan2cli.pipeline.offload import LayerStreamer, enable_block_offload, stray_tensors
from pan2cli.pipeline.pinned import ALIGN, HostArena, module_bytes
from pan2cli.pipeline.sampling import denoise
from pan2cli.scheduler import euler_step, guided
from tests.dit.small_models import random_small_pan2

TINY = dict(
    num_attention_heads=2, attention_head_dim=8, num_layers=4, num_refiner_layers=1, text_embed_dim=16,
    rope_axes_dim=(2, 2, 4),
)  # fmt: skip


def tiny_model(dtype=torch.float64, seed=0) -> PAN2Transformer3DModel:
    torch.manual_seed(seed)
    model = PAN2Transformer3DModel(**TINY).to(dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3)
    return model


def inputs(dtype=torch.float64, text=5, channels=16):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 97, 2, 4, 6, generator=generator, dtype=dtype)
    cond = torch.randn(1, text, channels, generator=generator, dtype=dtype)
    uncond = torch.randn(1, 3, channels, generator=generator, dtype=dtype)
    return x, torch.tensor([700.0]), cond, uncond


def _inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return tensor.numel() == 0 or start <= tensor.data_ptr() < start + buffer.numel()


# -- the fp8 blocks' tensors -----------------------------------------------------------------------------
def test_a_quantised_block_holds_every_tensor_as_a_parameter_or_buffer():
    """The fp8 attention's scale product is a buffer of its block: `.to()` and the streamer move it with the
    rest (as a plain attribute it stayed behind, and the streamed fp8 model read host memory on the GPU)."""
    model = quantize_transformer(random_small_pan2(head_dim=64))
    for block in model.transformer_blocks:
        assert stray_tensors(block) == []
        scales = block.attn.fp8_scales
        assert any(t is scales.qk_descale for t in block.buffers())
        assert scales.qk_descale.item() == pytest.approx(scales.q_descale * scales.k_descale, rel=1e-6)
    assert "qk_descale" not in " ".join(model.state_dict())  # not a checkpoint key


def test_the_streamer_moves_every_tensor_of_a_quantised_block_in_and_back_out():
    model = quantize_transformer(random_small_pan2(head_dim=64))
    set_fused_kernels(model, False)
    streamer = enable_block_offload(model, "cpu", streamed=[0, 1])
    seen = {}
    for index, block in enumerate(model.transformer_blocks):
        arena = streamer.arenas[index]
        tensors = list(dict.fromkeys((*block.parameters(), *block.buffers())))
        assert len(tensors) == len(arena.slots)  # the scales' buffer among them

        def before(module, args, arena=arena, tensors=tensors, index=index):
            seen[index, "in"] = [not _inside(t, arena.buffer) for t in tensors]

        def after(module, args, out, arena=arena, tensors=tensors, index=index):
            seen[index, "out"] = [_inside(t, arena.buffer) for t in tensors]

        # registered after the streamer's hooks: they run after its load, and after its unload
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)
        assert all(_inside(t, arena.buffer) for t in tensors)  # at rest: in host memory
    x, t, _, _ = inputs(torch.float32, channels=32)
    model(x, t, torch.randn(1, 5, 32))
    assert len(seen) == 4 and all(all(flags) for flags in seen.values())


def test_the_streamer_refuses_a_layer_holding_a_tensor_outside_its_parameters_and_buffers():
    layer = nn.Linear(4, 4)
    layer.table = torch.ones(3)  # a plain attribute: `.to()` and the streamer would leave it behind
    layer.scales = {"q": torch.ones(1)}
    assert stray_tensors(layer) == ["table", "scales['q']"]
    with pytest.raises(ValueError, match=r"layer 0 holds tensors outside .*\(table, scales\['q'\]\)"):
        LayerStreamer("cpu", [0]).attach(nn.ModuleList([layer]))


# -- the host arenas -----------------------------------------------------------------------------------
def test_an_arena_holds_a_module_in_one_buffer_exactly_its_aligned_size():
    module = nn.Sequential(nn.Linear(5, 3), nn.LayerNorm(3)).to(torch.bfloat16)
    module.register_buffer("empty", torch.zeros(0))
    values = [t.detach().clone() for t in module.state_dict().values()]
    arena = HostArena(module, pin=False)
    tensors = list(module.state_dict().values())
    assert arena.nbytes == module_bytes(module) == 4 * ALIGN  # four tensors of under 256 bytes, one empty
    offsets = [t.data_ptr() - arena.buffer.data_ptr() for t in tensors if t.numel()]
    assert all(map(_inside, tensors, [arena.buffer] * 5)) and [o % ALIGN for o in offsets] == [0] * 4
    assert all(torch.equal(a, b) for a, b in zip(tensors, values))
    arena.release_to(torch.device("cpu"))
    assert not any(_inside(t, arena.buffer) for t in module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), values))


def test_a_pinned_arena_locks_whole_pages_of_its_own_and_unlocks_them_when_collected(monkeypatch):
    """The registration (faked here: no GPU) covers the arena exactly, from a page boundary, so that two arenas
    never lock the same page; collecting the arena unlocks it after the device has finished its copies."""
    import gc

    from pan2cli.pipeline import pinned

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append(("lock", pointer, size))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unlock", pointer))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append(("synchronize",)))
    module = nn.Linear(300, 7)
    arena = HostArena(module, pin=True)
    pointer = arena.buffer.data_ptr()
    assert arena.pinned and calls == [("lock", pointer, arena.nbytes)] and pointer % pinned.PAGE == 0
    assert (
        arena.buffer.untyped_storage().nbytes() >= arena.nbytes + pinned.PAGE
    )  # a page of its own at the end
    del arena
    gc.collect()
    assert calls[1:] == [("synchronize",), ("unlock", pointer)]


def test_spread_picks_evenly_spaced_layers():
    assert spread(0, 44) == [] and spread(44, 44) == list(range(44)) and spread(50, 4) == [0, 1, 2, 3]
    assert spread(4, 44) == [0, 11, 22, 33]
    picked = spread(7, 44)
    assert len(set(picked)) == 7 and max(b - a for a, b in zip(picked, picked[1:])) <= 7


# -- equality with the resident model --------------------------------------------------------------------
@pytest.mark.parametrize("streamed", [[], [2], [0, 3], [0, 1, 2, 3]])
def test_a_partly_streamed_model_gives_the_resident_models_velocity(streamed):
    model = tiny_model()
    x, t, cond, _ = inputs()
    want = model(x, t, cond)
    streamer = enable_block_offload(model, "cpu", streamed=streamed)
    assert sorted(streamer.streamed) == sorted(streamer.arenas) == streamed
    assert torch.equal(model(x, t, cond), want)  # the same weights, the same ops
    resident = [i for i in range(4) if i not in streamed]
    assert all(
        not any(_inside(p, a.buffer) for a in streamer.arenas.values())
        for i in resident
        for p in model.transformer_blocks[i].parameters()
    )


def test_replanning_moves_layers_both_ways_and_keeps_the_velocity():
    model = tiny_model()
    x, t, cond, _ = inputs()
    want = model(x, t, cond)
    streamer = enable_block_offload(model, "cpu", streamed=[0, 2])
    kept = streamer.arenas[2]
    streamer = streamer.replan([1, 2, 3])
    assert sorted(streamer.arenas) == [1, 2, 3] and streamer.arenas[2] is kept
    assert not any(_inside(p, kept.buffer) for p in model.transformer_blocks[0].parameters())
    assert torch.equal(model(x, t, cond), want)


# -- both guidance passes through each block -----------------------------------------------------------
def test_the_two_passes_walk_equals_two_forwards_in_float64():
    """Prompt and negative prompt of different lengths, each block running both passes in one call: the same
    ops on the same tensors as two separate forwards, so the same numbers."""
    model = tiny_model()
    x, t, cond, uncond = inputs()
    calls = []
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(lambda module, args: calls.append(module))
    both = model.forward_passes(x, t, [cond, uncond])
    assert len(calls) == 4  # each block called once for both passes
    assert torch.equal(both[0], model(x, t, cond)) and torch.equal(both[1], model(x, t, uncond))


def test_a_denoise_walks_the_blocks_once_per_step_resident_or_streamed_and_gives_two_forwards_latents():
    model = tiny_model()
    x, _, cond, uncond = inputs()
    latents, condition = x[:, :48].float(), x[:, 48:]
    sigmas = [1.0, 0.6, 0.0]
    resident_calls = []
    model.transformer_blocks[1].register_forward_pre_hook(lambda module, args: resident_calls.append(1))
    want = denoise(model, latents, condition, cond, uncond, sigmas, 2.5, 1000)
    assert len(resident_calls) == 2  # resident too: one call of each block a step (one AdaLN modulation)
    for sigma, sigma_next in zip(
        sigmas[:-1], sigmas[1:]
    ):  # two separate forwards a step give the same latents
        timestep = torch.full((1,), sigma * 1000, dtype=torch.float32)
        x_t = torch.cat([latents.to(condition.dtype), condition], dim=1)
        v = guided(model(x_t, timestep, cond), model(x_t, timestep, uncond), 2.5)
        latents = euler_step(latents, v, sigma, sigma_next)
    assert torch.equal(latents, want)
    latents = x[:, :48].float()
    streamer = enable_block_offload(model, "cpu", streamed=[1, 3])
    loads = []
    model.transformer_blocks[1].register_forward_pre_hook(lambda module, args: loads.append(1))
    got = denoise(model, latents, condition, cond, uncond, sigmas, 2.5, 1000)
    assert len(loads) == 2  # block 1 came to the device once per step, for both passes
    assert torch.equal(got, want)
    assert sorted(streamer.arenas) == [1, 3]


# -- on a GPU --------------------------------------------------------------------------------------------
def _fp8_runs() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    from pan2cli.devices import fp8_unsupported_reason

    return fp8_unsupported_reason("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["cuda", "triton", "cudnn"])
def test_a_streamed_fp8_model_on_cuda_gives_the_resident_models_velocity(attention):
    """The fp8 blocks quantised where they were made (here the host, as for weights that stream), then run on
    the GPU resident, streamed whole, and partly streamed: the same kernels on the same weights give the same
    velocity. (Before the scales were a buffer, the GPU kernels read their host copy: an error from Triton, an
    illegal memory access in cuDNN.)"""
    if _fp8_runs():
        pytest.skip(_fp8_runs())
    if attention == "cudnn":
        pytest.importorskip("cudnn")
    if attention == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("pan2's CUDA fp8 attention runs on sm_90 GPUs")
    from pan2cli.dit.fp8_attention_choice import resolve_fp8_attention, use_fp8_attention

    choice = resolve_fp8_attention(attention, torch.device("cuda"), 128)
    host = quantize_transformer(random_small_pan2(head_dim=128).bfloat16())
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(1, 97, 3, 8, 12, generator=generator).bfloat16().cuda()
    t, cond = (
        torch.tensor([600.0], device="cuda"),
        torch.randn(1, 7, 32, generator=generator).bfloat16().cuda(),
    )
    resident = copy.deepcopy(host).cuda()
    set_fused_kernels(resident, True)
    use_fp8_attention(resident, choice)
    with torch.inference_mode():
        want = resident(x, t, cond)
        for streamed in ([0, 1], [1]):
            model = copy.deepcopy(host)
            enable_block_offload(model, "cuda", streamed=streamed)
            set_fused_kernels(model, True)
            use_fp8_attention(model, choice)
            got = model(x, t, cond)
            torch.cuda.synchronize()
            assert torch.equal(got, want), streamed
    assert torch.isfinite(want).all()


@pytest.mark.gpu
def test_a_partly_streamed_bf16_denoise_on_cuda_gives_the_resident_latents():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = random_small_pan2(head_dim=128).bfloat16()
    x, _, cond, uncond = (t.cuda() for t in inputs(torch.bfloat16, channels=32))
    latents, condition = x[:, :48].float(), x[:, 48:]
    sigmas = [1.0, 0.5, 0.0]
    resident = copy.deepcopy(model).cuda()
    set_fused_kernels(resident, True)
    with torch.inference_mode():
        want = denoise(resident, latents, condition, cond, uncond, sigmas, 2.5, 1000)
        streamer = enable_block_offload(model, "cuda", streamed=[1])
        set_fused_kernels(model, True)
        got = denoise(model, latents, condition, cond, uncond, sigmas, 2.5, 1000)
    assert all(arena.pinned for arena in streamer.arenas.values())
    assert torch.equal(got, want)


def test_a_module_packed_on_its_device_keeps_its_tensors_in_one_allocation():
    """`pack_on_device` (what `LayerStreamer.compact_resident` does to each resident block after a partly streamed
    load): the same parameter objects, the same values and dtypes, every tensor a view of one aligned allocation."""
    from pan2cli.pipeline.offload import pack_on_device
    from pan2cli.pipeline.pinned import ALIGN

    block = quantize_transformer(random_small_pan2(head_dim=128).bfloat16()).transformer_blocks[0]
    before = {name: t.detach().clone() for name, t in (*block.named_parameters(), *block.named_buffers())}
    objects = [id(t) for t in (*block.parameters(), *block.buffers())]
    pack_on_device(block, torch.device("cpu"))
    after = dict((*block.named_parameters(), *block.named_buffers()))
    assert [id(t) for t in (*block.parameters(), *block.buffers())] == objects
    assert all(
        torch.equal(after[name].view(torch.uint8), want.view(torch.uint8)) for name, want in before.items()
    )
    storages = {t.untyped_storage().data_ptr() for t in after.values()}
    assert len(storages) == 1
    base = storages.pop()
    assert all((t.data_ptr() - base) % ALIGN == 0 for t in after.values())
