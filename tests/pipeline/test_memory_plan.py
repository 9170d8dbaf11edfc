"""The memory plan (`pan2cli.pipeline.memory_plan`) at the release's sizes, and the host's memory (`pan2cli.host_memory`).

The sizes are the real model's, from its shapes (the transformer's 1,418 tensors, a Qwen3.5-9B config): the
plans are those a GPU run would make, for an 80 GB H100 (78.6 GiB free) capped at each size of the
acceptance table.
"""

from __future__ import annotations

import json

import pytest
import torch

from pan2cli.constants import latent_shape
from pan2cli.dit.checkpoint import expected_shapes, release_defaults
from pan2cli.errors import InputError
from pan2cli.host_memory import HostMemory, read_host_memory
from pan2cli.pipeline import memory_plan as mp
from pan2cli.pipeline.planning import text_encoder_sizes, transformer_sizes

GIB = 2**30
H100_FREE = int(78.6 * GIB)
CAPS = (80, 48, 32, 24, 16)
FRAMES = (121, 241, 481)


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    """The transformer in bf16 and fp8, and the text encoder, as they load."""
    shapes = expected_shapes(release_defaults())
    folder = tmp_path_factory.mktemp("text_encoder")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))  # Qwen3.5-9B's defaults
    return {
        "bf16": transformer_sizes(shapes, torch.bfloat16, "bf16"),
        "fp8": transformer_sizes(shapes, torch.bfloat16, "fp8"),
        "text": text_encoder_sizes(folder, torch.bfloat16),
    }


def shape(precision: str, frames: int, **changes) -> mp.RunShape:
    _, _, t, h, w = latent_shape(frames, 704, 1248)
    return mp.RunShape(precision, t * (h // 2) * (w // 2), 704 * 1248, frames, **changes)


def plan(sizes, precision, frames, cap_gib, *, host=None, free=H100_FREE, **options):
    return mp.plan_memory(
        shape=shape(precision, frames), transformer=sizes[precision], text_encoder=sizes["text"],
        free_bytes=free, cap_bytes=int(cap_gib * GIB) if cap_gib else None, host=host,
        decoder_kernel=options.pop("decoder_kernel", True), chunk_latent_frames=4,
        alternatives=[mp.Alternative("--precision fp8", "fp8", sizes["fp8"])] if precision == "bf16" else [],
        **options,
    )  # fmt: skip


def test_the_sizes_are_the_measured_weights(sizes):
    """62.71 GiB in bf16 (AdaLN float32) and 40.72 GiB in fp8, as measured on the GPU (docs/BENCHMARKS.md)."""
    assert sizes["bf16"].total / GIB == pytest.approx(62.71, abs=0.01)
    assert sizes["fp8"].total / GIB == pytest.approx(40.72, abs=0.01)
    assert len(sizes["bf16"].layer_bytes) == 44 and len(sizes["text"].layer_bytes) == 30


def test_the_activation_model_gives_the_measured_peaks():
    for precision, (weights, points) in mp.MEASURED_DIT_PEAKS.items():
        for tokens, peak in points:
            predicted = mp.activation_bytes(precision, tokens + mp.MEASURED_TEXT_TOKENS) / GIB
            assert predicted == pytest.approx(peak - weights, abs=0.02), (precision, tokens)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("frames", FRAMES)
def test_every_cap_gives_a_plan_whose_stages_fit_or_a_reason(sizes, precision, frames):
    streamed_before = -1
    for cap in CAPS:  # largest first: as the cap shrinks, more blocks stream, never fewer
        budget = min(cap * GIB, H100_FREE) - mp.MARGIN_BYTES
        tokens = shape(precision, frames).video_tokens + mp.MAX_TEXT_TOKENS
        activations = mp.activation_bytes(precision, tokens)
        try:
            p = plan(sizes, precision, frames, cap)
        except InputError as error:
            # only when even every block streamed leaves no room for the activations (both passes' hidden states)
            blocks = mp.STREAM_BUFFERS * sizes[precision].layer_bytes[0]
            floor = sizes[precision].other_bytes + activations + tokens * 4096 * 2 + blocks
            assert floor > budget, (cap, str(error))
            assert "even with every transformer block streamed" in str(error)
            streamed_before = 45
            continue
        dit = p.transformer
        assert dit.stage_bytes <= budget and p.text_encoder.stage_bytes <= budget
        assert mp.decoder_bytes(True, 704 * 1248, p.chunk_latent_frames) <= budget
        assert dit.stage_bytes >= sizes[precision].other_bytes + activations  # the activations are counted
        assert len(dit.streamed) >= streamed_before
        streamed_before = len(dit.streamed)
        assert list(dit.streamed) == mp.spread(len(dit.streamed), 44)
        assert (
            p.bytes_per_step
            == dit.streamed_bytes
            == sum(sizes[precision].layer_bytes[i] for i in dit.streamed)
        )
        if dit.streamed:  # the fewest: one block fewer streamed would not fit
            assert sizes[precision].layer_bytes[0] + dit.stage_bytes > budget
        assert p.record()["streamed_blocks"] == list(dit.streamed)


def test_what_each_card_runs_at_the_lengths_of_the_acceptance_table(sizes):
    # An 80 GB card holds bf16 at 121 frames whole (66.9 GiB measured) and streams only a few blocks at 481
    assert not plan(sizes, "bf16", 121, 80).transformer.streamed
    at_481 = plan(sizes, "bf16", 481, None).transformer
    assert 1 <= len(at_481.streamed) <= 8 and at_481.resident >= 36
    # fp8 needs no streaming on 48 GB at 121 frames; 16 GiB runs 121 frames in both precisions (blocks streamed)
    assert not plan(sizes, "fp8", 121, 48).transformer.streamed
    for precision in ("bf16", "fp8"):
        small = plan(sizes, precision, 121, 16)
        assert small.transformer.streamed and not small.text_encoder.streamed  # 14.0 GiB of text model fit
    # below that, the text model's layers stream too
    assert plan(sizes, "fp8", 121, 14).text_encoder.streamed
    # --offload streams every block whatever fits
    forced = plan(sizes, "bf16", 121, None, stream_all=True)
    assert forced.transformer.streamed == tuple(range(44)) and "--offload" in forced.reason


def test_the_plan_line_says_what_streams_and_the_bus_traffic(sizes):
    line = plan(sizes, "bf16", 121, 24).line()
    p = plan(sizes, "bf16", 121, 24)
    assert line.startswith(f"Memory plan: {p.transformer.resident} of 44 transformer blocks resident, ")
    assert f"{p.bytes_per_step / 1e9:.1f} GB over the bus per step" in line and "PCIe 4" in line
    assert "--max-gpu-memory" in line
    resident = plan(sizes, "fp8", 121, None).line()
    assert resident.startswith("Memory plan: all 44 transformer blocks resident: weights 40.7 GiB")


def test_the_reference_decoder_takes_a_smaller_chunk_to_fit_and_the_kernel_does_not_need_to(sizes):
    p = plan(sizes, "fp8", 121, 16, decoder_kernel=False)
    assert p.chunk_latent_frames < 4 and "decoder chunk" in p.line()
    assert mp.decoder_bytes(False, 704 * 1248, p.chunk_latent_frames) <= p.budget_bytes
    assert plan(sizes, "fp8", 121, 16).chunk_latent_frames == 4


def test_a_decoder_kept_beside_the_transformer_counts_in_the_denoising_stage(sizes):
    alone = plan(sizes, "bf16", 121, 32).transformer
    beside = plan(sizes, "bf16", 121, 32, decoder_beside_transformer=True).transformer
    assert beside.stage_bytes + mp.DECODER_WEIGHT_BYTES <= 31 * GIB
    assert len(beside.streamed) == len(alone.streamed) + 1


# -- the host's memory ------------------------------------------------------------------------------------
def host(available_gib: float, shmem_gib: float = 0.0, cache_gib: float = 5.0) -> HostMemory:
    return HostMemory(
        int(available_gib * GIB), int(available_gib * GIB), int(cache_gib * GIB), int(shmem_gib * GIB)
    )


def test_a_plan_the_host_cannot_page_lock_is_refused_before_anything_loads_with_what_would_fit(sizes):
    p = plan(sizes, "bf16", 121, 24)
    need = (p.host_bytes + mp.HOST_ALLOWANCE_BYTES) / GIB
    assert plan(sizes, "bf16", 121, 24, host=host(need + 0.1)).host_bytes == p.host_bytes
    with pytest.raises(InputError) as info:
        plan(sizes, "bf16", 121, 24, host=host(need - 1, shmem_gib=63))
    message, hint = str(info.value), info.value.hint
    assert f"holds {len(p.transformer.streamed)} of the 44 transformer blocks" in message
    assert "in host memory" in message and "MemAvailable" in message
    assert "page cache" in message and "63.0 GiB held by tmpfs files (/dev/shm) are not available" in message
    assert "--precision fp8 page-locks" in hint and "a larger --max-gpu-memory" in hint
    # a plan that streams nothing needs no host memory, however little there is
    assert plan(sizes, "bf16", 121, 80, host=host(0.5)).host_bytes == 0


def test_read_host_memory_takes_memavailable_within_the_cgroups_room(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       131072000 kB\nMemFree:         2000000 kB\nMemAvailable:   60000000 kB\n"
        "Cached:         70000000 kB\nShmem:          66000000 kB\n"
    )
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    memory = read_host_memory(meminfo, cgroup)  # no limit files: the machine's
    assert memory.available == memory.mem_available == 60000000 * 1024 and memory.cgroup_room is None
    assert memory.shmem == 66000000 * 1024 and memory.page_cache == 4000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert read_host_memory(meminfo, cgroup).cgroup_room is None
    (cgroup / "memory.max").write_text(f"{40 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{10 * GIB}\n")
    (cgroup / "memory.stat").write_text(f"anon 1\nactive_file {GIB}\ninactive_file {GIB}\n")
    limited = read_host_memory(meminfo, cgroup)
    assert limited.cgroup_room == limited.available == 32 * GIB
    assert "its cgroup's limit" in limited.describe()
    assert read_host_memory(tmp_path / "missing", cgroup) is None


# -- a plan applied by the pipeline ------------------------------------------------------------------------
def test_the_pipeline_runs_the_plan_and_records_it(tiny_pan2, monkeypatch, writer_chunks, tmp_path):
    """On the CPU (where pan2 itself plans nothing) a plan put in its place: block 1 of 2 and text layer 0 of 2
    stream, the decoder takes chunks of 1 latent frame. The video is the resident run's; the plan is said in one
    line and recorded in the sidecar."""
    from pan2cli.config import RuntimeConfig
    from pan2cli.pipeline import VideoGenerator, planning
    from pan2cli.pipeline.offload import LayerStreamer

    settings = dict(preset="pan2-5s", steps=2, frames=9, height=64, width=96)
    resident = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))
    want = resident.generate("a kite over the dunes", **settings)
    assert json.loads(json.dumps(resident.sidecar(want)))["memory_plan"] is None

    layer = mp.LayerPlan((1,), 2, 10 * GIB, 123)
    forced = mp.MemoryPlan(
        16 * GIB, 17 * GIB, 40 * GIB, layer, mp.LayerPlan((0,), 2, GIB, 7), 1, False, 123, 123,
        shape("bf16", 9), "a plan made by the test",
    )  # fmt: skip
    monkeypatch.setattr(planning, "make_plan", lambda *args, **kwargs: forced)
    attached = []
    real_attach = LayerStreamer.attach
    monkeypatch.setattr(
        LayerStreamer,
        "attach",
        lambda self, layers: attached.append(self.streamed) or real_attach(self, layers),
    )
    lines = []
    generator = VideoGenerator.from_pretrained(
        tiny_pan2, config=RuntimeConfig(device="cpu"), info=lines.append
    )
    writer_chunks.clear()
    got = generator.generate("a kite over the dunes", output=tmp_path / "kite.mp4", **settings)
    assert forced.line() in lines and writer_chunks == [1, 4, 4]  # one latent frame per decoder pass
    assert attached == [[0], [1]]  # the text encoder's layer 0, then the transformer's block 1
    assert torch.allclose(got.latents, want.latents, rtol=0, atol=1e-5)  # the same weights and ops
    side = json.loads((tmp_path / "kite.json").read_text())
    assert side["memory_plan"] == forced.record() and side["memory_plan"]["streamed_blocks"] == [1]


def test_max_gpu_memory_on_the_cpu_runs_says_it_changes_nothing_and_is_recorded(tiny_pan2, run_cli, tmp_path):
    out = tmp_path / "fox.mp4"
    res = run_cli(
        "generate", "a fox", "--model", tiny_pan2, "--steps", 1, "--frames", 5, "--size", "64x96",
        "--device", "cpu", "--max-gpu-memory", 24, "-o", out,
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    warnings = [line for line in res.stderr.splitlines() if line.startswith("Warning:")]
    assert warnings == [
        "Warning: --max-gpu-memory changes nothing on the CPU: it caps what a run may use of a GPU"
    ]
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["config"]["max_gpu_memory_gib"] == 24 and side["memory_plan"] is None
    bad = run_cli("generate", "a fox", "--model", tiny_pan2, "--device", "cpu", "--max-gpu-memory", 0)
    assert bad.exit_code == 2 and "--max-gpu-memory" in bad.stderr
