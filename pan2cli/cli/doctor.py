"""`pan2 doctor`: what this machine offers pan2 (Python, torch, CUDA, GPUs, caches, decode path)."""

from __future__ import annotations

import json
import platform
import sys

import click

from pan2cli.cli._output import result
from pan2cli.devices import resolve_dtype
from pan2cli.paths import cache_dir
from pan2cli.version import __version__


def _ffmpeg() -> str:
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as exc:  # a missing binary is a finding, not a crash
        return f"not found ({exc})"


def _hf_cache() -> str:
    from huggingface_hub import constants

    offline = " (offline: HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
    return f"{constants.HF_HUB_CACHE}{offline}"


def collect_report() -> dict:
    """Everything `pan2 doctor` prints, as a dict (also its --json output)."""
    import torch  # here, not at the top: `pan2 --help` does not load torch

    from pan2cli.vae.kernel.status import kernel_status

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return {
        "pan2cli": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none (CPU build of torch)",
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "ffmpeg": _ffmpeg(),
        "cache_dir": str(cache_dir()),
        "hf_cache": _hf_cache(),
        "decode_default": f"{device}, {str(resolve_dtype(None, device)).removeprefix('torch.')}",
        "decode_path": kernel_status().decode_path,
        "attention": _attention(device),
        "fp8": _fp8(device),
    }


def _fp8(device) -> str:
    """Whether `--precision fp8` runs here, and which fp8 attention its default (`--fp8-attention auto`) would
    take and why (the CUDA kernel's instantiation at 5 s and 20 s of video too), or why fp8 does not run."""
    import torch

    from pan2cli.devices import fp8_unsupported_reason
    from pan2cli.dit import cuda_fp8_attention as cuda
    from pan2cli.dit.checkpoint import release_defaults
    from pan2cli.dit.fp8_attention_choice import DESCRIPTIONS, resolve_fp8_attention

    reason = fp8_unsupported_reason(device)
    if reason is not None:
        return f"no: {reason}"
    choice = resolve_fp8_attention("auto", device, release_defaults()["attention_head_dim"], build=False)
    attention = f"{DESCRIPTIONS[choice.kernel]}: {choice.reason}"
    if choice.kernel == "cuda":
        gpu = torch.cuda.get_device_name(device)
        by_pick: dict[str, list[str]] = {}
        for frames, tokens in ((121, 26_598 + 300), (481, 103_818 + 300)):  # 704x1248, a prompt's ~300 tokens
            by_pick.setdefault(cuda.choose_instantiation(gpu, tokens).name, []).append(str(frames))
        picks = ", ".join(f"{name} at {' and '.join(frames)} frames" for name, frames in by_pick.items())
        built = "built" if cuda.extension_spec().library.exists() else "built on first use"
        attention += f"; {built}; {picks} (the {cuda.table_gpu(gpu)} rows of its table)"
    return f"yes (--precision fp8: e4m3 linears, {attention}; --fp8-attention picks another)"


def _attention(device) -> str:
    """The SDPA backend PAN 2's joint attention would take here (bf16 on a GPU), and the priority."""
    import torch

    from pan2cli.dit.attention import attention_backend, attention_order
    from pan2cli.dit.checkpoint import release_defaults
    from pan2cli.errors import InputError

    release = release_defaults()
    try:
        order = attention_order()
        chosen = attention_backend(
            device, torch.bfloat16, release["num_attention_heads"], release["attention_head_dim"]
        )
    except InputError as exc:  # a bad PAN2_ATTENTION: doctor reports it rather than failing
        return str(exc)
    return f"{chosen} (priority {' > '.join(order)}; PAN2_ATTENTION puts one first)"


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor_command(as_json):
    """Report Python, torch, CUDA, GPUs, ffmpeg, cache folders, which decode path would run and whether fp8 runs.

    \b
    Examples:
      pan2 doctor
      pan2 doctor --json
    """
    report = collect_report()
    if as_json:
        result(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key == "gpus":
            value = (
                "; ".join(
                    f"{g['index']}: {g['name']} (sm {g['compute_capability']}, {g['memory_gib']} GiB)"
                    for g in value
                )
                or "none"
            )
        result(f"{key:<15} {value}")
