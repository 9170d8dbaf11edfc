"""`--precision bf16|fp8`: the option, its precedence (preset < flag), its refusal where fp8 cannot run, and the
transformer loaded as fp8 (each block quantised as it is read)."""

from __future__ import annotations

import copy

import pytest
import torch

from pan2cli.config import RuntimeConfig, runtime_with
from pan2cli.errors import InputError
from pan2cli.presets import load_preset, preset_to_toml

CLI_SMALL = ("--size", "64x64", "--frames", 5, "--steps", 2, "--device", "cpu")


def test_precision_is_a_checked_runtime_option():
    assert RuntimeConfig().precision is None  # left to the preset, else bf16
    assert runtime_with(None, RuntimeConfig()).precision == "bf16"
    assert RuntimeConfig(precision="fp8").precision == "fp8"
    with pytest.raises(InputError, match="'precision' = 'fp16'.*bf16, fp8"):
        RuntimeConfig(precision="fp16")
    with pytest.raises(InputError, match="fp8 needs a CUDA GPU"):
        RuntimeConfig(precision="fp8").check_precision(torch.device("cpu"))
    with pytest.raises(InputError, match="fused DiT kernels"):
        RuntimeConfig(precision="fp8", dit_fused_kernels=False).check_precision(torch.device("cpu"))
    RuntimeConfig(precision="bf16").check_precision(torch.device("cpu"))  # nothing to check


def test_a_preset_may_set_the_precision_and_shows_it(tmp_path):
    shipped = load_preset("pan2-5s")
    assert shipped.precision is None
    assert "# precision: not set (bf16 unless --precision is given)" in preset_to_toml(shipped)
    path = tmp_path / "fast.toml"
    path.write_text(preset_to_toml(shipped).replace("# precision: not set", 'precision = "fp8"\n#'))
    assert load_preset(path).precision == "fp8"
    assert 'precision = "fp8"' in preset_to_toml(load_preset(path))
    path.write_text(preset_to_toml(shipped).replace("# precision: not set", 'precision = "int4"\n#'))
    with pytest.raises(InputError, match="'precision' = 'int4'"):
        load_preset(path)


def test_fp8_on_the_cpu_is_refused_before_anything_loads(tiny_pan2, run_cli, tmp_path, monkeypatch):
    import pan2cli.pipeline.generator as generator

    monkeypatch.setattr(
        generator.VideoGenerator, "_read_dit", lambda self, on_tensor=None: pytest.fail("the DiT loaded")
    )
    out = tmp_path / "a.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--precision", "fp8", "-o", out)
    assert res.exit_code == 2
    assert "Error: --precision fp8: fp8 needs a CUDA GPU" in res.stderr and "--precision bf16" in res.stderr
    assert not out.exists()


def test_the_flag_wins_over_the_preset_and_the_sidecar_records_what_ran(tiny_pan2, run_cli, tmp_path):
    preset = tmp_path / "fp8.toml"
    preset.write_text(
        preset_to_toml(load_preset("pan2-5s")).replace("# precision: not set", 'precision = "fp8"\n#')
    )
    res = run_cli(
        "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--preset", preset, "-o", tmp_path / "a.mp4"
    )
    # the preset's fp8, refused on the CPU naming the preset, not a flag the user did not give
    assert res.exit_code == 2
    assert res.stderr.splitlines()[0].startswith(
        f'Error: preset {preset} sets precision = "fp8": fp8 needs a CUDA GPU'
    )
    assert "--precision fp8" not in res.stderr
    out = tmp_path / "b.mp4"
    res = run_cli(
        "generate",
        "a cat",
        "--model",
        tiny_pan2,
        *CLI_SMALL,
        "--preset",
        preset,
        "--precision",
        "bf16",
        "-o",
        out,
    )
    assert res.exit_code == 0, res.stderr
    import json

    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["config"]["precision"] == "bf16"
    # what ran on the CPU: the DiT in float32, not bf16; the flag that overrode the preset is an override
    assert sidecar["ran"]["precision"] == "float32" and sidecar["ran"]["fp8_attention"] is None
    assert sidecar["overrides"]["precision"] == {"value": "bf16", "from": "--precision"}


def test_an_fp8_load_quantises_every_block_and_keeps_the_rest(tiny_pan2):
    from pan2cli.dit.checkpoint import load_pan2_transformer
    from pan2cli.dit.fp8 import Fp8Linear
    from pan2cli.dit.fusions import set_fused_kernels

    bf16 = load_pan2_transformer(tiny_pan2, subfolder="transformer", dtype=torch.float32)
    fp8 = load_pan2_transformer(tiny_pan2, subfolder="transformer", dtype=torch.float32, precision="fp8")
    assert fp8.precision == "fp8" and bf16.precision == "bf16"
    for block in fp8.transformer_blocks:
        assert isinstance(block.attn.to_q, Fp8Linear) and isinstance(block.ff_context.net[2], Fp8Linear)
        assert block.norm1.linear.weight.dtype == torch.float32 and not block.norm1.linear.weight.is_meta
    assert not any(t.is_meta for t in (*fp8.parameters(), *fp8.buffers()))
    torch.testing.assert_close(fp8.proj_out.weight, bf16.proj_out.weight, rtol=0, atol=0)
    set_fused_kernels(fp8, False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 97, 2, 4, 4, generator=gen)
    ctx = torch.randn(1, 3, bf16.config.text_embed_dim, generator=gen)
    t = torch.tensor([500.0])
    with torch.no_grad():
        want, got = bf16(x, t, ctx), copy.deepcopy(fp8)(x, t, ctx)
    error = float((got - want).norm() / want.norm())
    assert 1e-4 < error < 0.1, error


def test_the_fp8_attention_is_a_checked_runtime_option(monkeypatch):
    """`fp8_attention` (`--fp8-attention`): auto by default, one of four names, and a kernel asked for that cannot
    run here is bad input before anything loads: ours needs an sm_90 GPU, cuDNN's its frontend package."""
    import pan2cli.devices as devices

    assert RuntimeConfig().fp8_attention == "auto"
    with pytest.raises(InputError, match="'fp8_attention' = 'flash'.*auto, cuda, triton, cudnn"):
        RuntimeConfig(fp8_attention="flash")
    monkeypatch.setattr(devices, "fp8_unsupported_reason", lambda device: None)  # an fp8 GPU
    monkeypatch.setattr(devices, "compute_capability", lambda device: (8, 9))  # an Ada one
    gpu = torch.device("cuda")
    for kernel in ("auto", "triton"):
        RuntimeConfig(precision="fp8", fp8_attention=kernel).check_precision(gpu)
    with pytest.raises(InputError, match="--fp8-attention cuda: .*sm_90 GPUs.*this one is sm_89") as error:
        RuntimeConfig(precision="fp8", fp8_attention="cuda").check_precision(gpu)
    assert "--fp8-attention auto" in error.value.hint
    monkeypatch.setattr(devices, "compute_capability", lambda device: (9, 0))
    RuntimeConfig(precision="fp8", fp8_attention="cuda").check_precision(gpu)
    import importlib.util

    if importlib.util.find_spec("cudnn") is None:
        with pytest.raises(InputError, match="--fp8-attention cudnn: .*nvidia-cudnn-frontend"):
            RuntimeConfig(precision="fp8", fp8_attention="cudnn").check_precision(gpu)
    RuntimeConfig(fp8_attention="cuda").check_precision(torch.device("cpu"))  # bf16: nothing to check


def test_an_fp8_run_records_the_fp8_attention_that_ran(tiny_pan2, run_cli, tmp_path, monkeypatch):
    """`pan2 generate --precision fp8` through to the sidecar, with fp8 let through on the CPU: every block's
    attention of every forward ran the fp8 attention (its CPU emulation, the fused kernels being off there),
    and `ran.fp8_attention` says so with the count; the option as given is in `config`."""
    import json

    import pan2cli.devices as devices

    monkeypatch.setattr(devices, "fp8_unsupported_reason", lambda device: None)
    out = tmp_path / "a.mp4"
    args = ("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--precision", "fp8", "-o", out)
    res = run_cli(*args, "--fp8-attention", "triton")
    assert res.exit_code == 0, res.stderr
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["config"]["fp8_attention"] == "triton" and sidecar["ran"]["precision"] == "fp8"
    layers, forwards, steps = 2, 2, 2  # the tiny model's blocks; conditional and unconditional passes
    assert sidecar["ran"]["fp8_attention"] == {
        "kernel": "emulation",
        "why": None,
        "calls": layers * forwards * steps,
        "instantiations": [],
    }


def test_doctor_names_the_fp8_attention_that_would_run_and_why(monkeypatch, tmp_path):
    """On an H100 the default is our CUDA kernel (not yet built here), with the instantiations its table picks
    for 5 s and 20 s of video; on an Ada GPU the Triton kernel, with the reason."""
    import pan2cli.devices as devices
    from pan2cli.cli import doctor
    from pan2cli.dit import cuda_fp8_attention as cuda

    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(devices, "fp8_unsupported_reason", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cuda, "why_not_runnable", lambda device, head_dim: None)
    line = doctor._fp8(torch.device("cuda"))
    assert line.startswith(
        "yes (--precision fp8: e4m3 linears, pan2's CUDA fp8 attention: the default on sm_90"
    )
    assert "built on first use" in line and "--fp8-attention picks another" in line
    assert "s3-free-tma-k224 at 121 and 481 frames (the H100 rows of its table)" in line
    monkeypatch.setattr(
        cuda, "why_not_runnable", lambda device, head_dim: "it runs on sm_90 GPUs, this one is sm_89"
    )
    line = doctor._fp8(torch.device("cuda"))
    assert (
        "pan2's Triton fp8 attention: pan2's CUDA fp8 attention does not run here: it runs on sm_90" in line
    )
