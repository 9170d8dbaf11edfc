"""How far the fp8 tier moves PAN 2's output, measured three ways on one GPU (random weights: the release's
weights cannot be downloaded here; random weights tend to amplify rounding more than trained ones).

1. `--full`: the full-size transformer (release config, random weights of one seed), one forward's velocity at
   `--frames` (704x1248) with a 300-token prompt, fp8 against bf16, for each choice: per-token or per-tensor
   activation scales, the fp8 attention (the default, `--fp8-attention auto`: our CUDA kernel on sm_90 GPUs;
   our Triton kernel; cuDNN's where cudnn-frontend is installed) or bf16 attention, the first and last block
   kept in bf16. Relative RMS error and cosine similarity.
2. `--reduced`: a reduced model (4 blocks of 4 heads x 128) against its own float64 forward, for bf16 and
   fp8, so that fp8's error is seen next to bf16's own.
3. `--video`: a tiny random repository (`pan2cli.testing.tiny_pan2`'s writers, that reduced transformer) through
   `VideoGenerator`, 50 steps with CFG, bf16 and fp8 from the same seed; PSNR (and max difference) of the two
   decoded uint8 videos.

    python3 scripts/fp8_accuracy.py --full --reduced --video --out accuracy.json
    python3 scripts/fp8_accuracy.py --write-repo /tmp/reduced   # then: pan2 generate ... --model /tmp/reduced
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2cli.dit.fp8_attention_choice import resolve_fp8_attention, use_fp8_attention  # noqa: E402
from pan2cli.dit.quantize import Fp8Policy, quantize_transformer  # noqa: E402
from scripts.make_random_pan2 import random_transformer  # noqa: E402

REDUCED = dict(
    num_attention_heads=4, attention_head_dim=128, num_layers=4, num_refiner_layers=1, text_embed_dim=32,
    rope_axes_dim=(16, 56, 56),
)  # fmt: skip
FULL_CHOICES = {  # key → (row name, policy, --fp8-attention)
    "tier": ("fp8 (per-token, the default fp8 attention: the tier)", Fp8Policy(), "auto"),
    "triton": ("fp8, our Triton fp8 attention", Fp8Policy(), "triton"),
    "cudnn": ("fp8, cuDNN's fp8 attention", Fp8Policy(), "cudnn"),
    "unrotated": (
        "fp8, Q/K neither rotated nor K smoothed",
        Fp8Policy(qk_hadamard=False, smooth_k=False),
        "auto",
    ),
    "bf16-attention": ("fp8 linears, bf16 attention", Fp8Policy(attention=False), "auto"),
    "per-tensor": ("fp8, per-tensor activation scales", Fp8Policy(activation_scaling="tensor"), "auto"),
    "bf16-ends": ("fp8, first and last block bf16", Fp8Policy(bf16_blocks=frozenset({0, 43})), "auto"),
}


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    got, want = got.double().flatten(), want.double().flatten()
    return {
        "rel_rms": round(float((got - want).norm() / want.norm()), 5),
        "cosine": round(float(torch.nn.functional.cosine_similarity(got, want, dim=0)), 6),
    }


def inputs(config: dict, frames: int, height: int, width: int, device, dtype, text: int = 300):
    gen = torch.Generator(device=device).manual_seed(7)
    shape = (1, 97, 1 + (frames - 1) // 4, height // 16, width // 16)
    hidden = torch.randn(shape, generator=gen, device=device).to(dtype)
    ctx = torch.randn(1, text, config.get("text_embed_dim", 4096), generator=gen, device=device).to(dtype)
    return hidden, torch.tensor([700.0], device=device), ctx


def full_size(frames: int, choices: list[str]) -> dict:
    device = torch.device("cuda")
    rows = {}
    with torch.inference_mode():
        model = random_transformer(device)
        hidden, t, ctx = inputs({}, frames, 704, 1248, device, torch.bfloat16)
        want = model(hidden, t, ctx).float()
        del model
        torch.cuda.empty_cache()
        for name, policy, requested in (FULL_CHOICES[key] for key in choices):
            try:
                choice = resolve_fp8_attention(requested, device, 128)
            except Exception as error:  # cuDNN's without cudnn-frontend: said in the results
                rows[name] = {"unavailable": str(error).splitlines()[0]}
                continue
            model = random_transformer(device, precision="fp8", policy=policy)
            use_fp8_attention(model, choice)
            attention = choice.kernel if policy.attention else "bf16 sdpa"
            rows[name] = {**compare(model(hidden, t, ctx), want), "fp8_attention": attention}
            print(json.dumps({"full": name, **rows[name]}), flush=True)
            del model
            torch.cuda.empty_cache()
    return rows


def reduced() -> dict:
    device = torch.device("cuda")
    rows = {}
    with torch.inference_mode():
        model = random_transformer(device, **REDUCED)  # bf16, AdaLN float32
        exact = copy.deepcopy(model).double()
        hidden, t, ctx = inputs(REDUCED, 33, 352, 640, device, torch.float64)
        want = exact(hidden, t, ctx)
        rows["bf16"] = compare(model(hidden, t, ctx), want)
        for name, policy in (("fp8", Fp8Policy()), ("fp8, bf16 attention", Fp8Policy(attention=False))):
            rows[name] = compare(quantize_transformer(copy.deepcopy(model), policy)(hidden, t, ctx), want)
        print(json.dumps({"reduced": rows}), flush=True)
    return rows


def write_reduced_repo(root: Path) -> Path:
    """A tiny random repository in the release's layout whose transformer is `REDUCED` (head_dim 128, as the
    fp8 kernels want): `pan2cli.testing.tiny_pan2`'s tokenizer, text encoder, VAE and scheduler."""
    from pan2cli.testing.tiny_pan2 import (
        tiny_text_model,
        write_scheduler_and_index,
        write_text_encoder,
        write_tokenizer,
        write_transformer,
        write_vae,
    )
    from pan2cli.testing.transformers_logging import quiet_transformers

    with quiet_transformers():
        tokenizer = write_tokenizer(root / "tokenizer")
        write_text_encoder(root / "text_encoder", tiny_text_model(len(tokenizer), seed=0))
    transformer = random_transformer(torch.device("cuda"), seed=3, **REDUCED).cpu()  # bf16, AdaLN float32
    write_transformer(root / "transformer", transformer)
    write_vae(root / "vae", seed=0)
    write_scheduler_and_index(root, type(tokenizer).__name__)
    return root


def video(steps: int) -> dict:
    from pan2cli.config import RuntimeConfig
    from pan2cli.frames import psnr
    from pan2cli.pipeline import VideoGenerator

    with tempfile.TemporaryDirectory(prefix="pan2-fp8-") as folder:
        root = write_reduced_repo(Path(folder))
        frames = {}
        for precision in ("bf16", "fp8"):
            config = RuntimeConfig(device="cuda", precision=precision, decode_kernel="off")
            generator = VideoGenerator.from_pretrained(root, config=config)
            result = generator.generate(
                "a red fox runs through the snow", preset="pan2-5s", steps=steps, frames=33, height=352, width=640,
            )  # fmt: skip
            frames[precision] = result.frames
            del generator
            torch.cuda.empty_cache()
        a, b = frames["bf16"], frames["fp8"]
        diff = (a.float() - b.float()).abs()
        row = {
            "frames": list(a.shape), "steps": steps,
            "psnr_db": round(float(psnr(a, b)), 2),
            "max_abs_diff_levels": int(diff.max()),
            "mean_abs_diff_levels": round(float(diff.mean()), 3),
        }  # fmt: skip
        print(json.dumps({"video": row}), flush=True)
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument(
        "--choices",
        default=",".join(FULL_CHOICES),
        help=f"with --full: the fp8 variants to build, comma-separated (default all: {','.join(FULL_CHOICES)})",
    )
    parser.add_argument("--reduced", action="store_true")
    parser.add_argument("--video", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--write-repo", type=Path, help="only write the reduced random repository there (for `pan2 generate`)"
    )
    args = parser.parse_args()
    if args.write_repo:
        print(write_reduced_repo(args.write_repo))
        return
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.reduced:
        results["reduced_vs_float64"] = reduced()
    if args.video:
        results["video_fp8_vs_bf16"] = video(args.steps)
    if args.full:
        results["full_size_fp8_vs_bf16"] = full_size(args.frames, args.choices.split(","))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
