"""pan2's Qwen3.5 text encoder against transformers' `Qwen3_5TextModel` on one checkpoint (full size on a GPU).

Both in bf16 on the same prompts, against pan2's in float32 as the reference: relative RMS error and cosine of
the features PAN 2 uses (`hidden_states[-3]` after the user header), and the seconds of each model's load and
encoding. transformers is the oracle here, as diffusers is for the decoder; `pan2 generate` never imports its
model classes.

    python3 scripts/compare_text_encoder.py --model /tmp/pan2full
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2cli.testing.transformers_logging import quiet_transformers  # noqa: E402
from pan2cli.text.checkpoint import HIDDEN_LAYER, load_text_model, load_tokenizer  # noqa: E402
from pan2cli.text.encoder import PAN2TextEncoder  # noqa: E402

PROMPTS = (
    "A red fox runs through the snow at dawn, the camera follows it low to the ground.",
    "A busy street market in the rain at night, neon signs reflected in puddles, people with umbrellas.",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a PAN 2 repository folder")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def _timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


class _TransformersModel(torch.nn.Module):
    """transformers' class behind the interface PAN2TextEncoder calls: ids → hidden_states[-3]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        with quiet_transformers():
            return self.model(input_ids=input_ids, output_hidden_states=True).hidden_states[HIDDEN_LAYER]


def _transformers(folder: Path, device: torch.device):
    from transformers import Qwen3_5TextModel

    try:
        import accelerate  # noqa: F401  (transformers places a model on a GPU only through it)

        placement = {"device_map": {"": device}}
    except ImportError:
        placement = {}
    with quiet_transformers():
        model = Qwen3_5TextModel.from_pretrained(
            str(folder), dtype=torch.bfloat16, local_files_only=True, **placement
        )
    return _TransformersModel(model.to(device).eval())


def _errors(x: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    x, reference = x.double().flatten(), reference.double().flatten()
    return {
        "relative_rms": ((x - reference).norm() / reference.norm()).item(),
        "cosine": torch.nn.functional.cosine_similarity(x, reference, dim=0).item(),
    }


@torch.inference_mode()
def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.model / "tokenizer")
    folder = args.model / "text_encoder"
    report: dict[str, dict] = {"seconds": {}, "errors": {}}
    features: dict[str, list[torch.Tensor]] = {}
    builders = {
        "pan2 bf16": lambda: load_text_model(folder, dtype=torch.bfloat16, device=device),
        "transformers bf16": lambda: _transformers(folder, device),
        "pan2 float32": lambda: load_text_model(folder, dtype=torch.float32, device=device),
    }
    for name, build in builders.items():
        model, load_s = _timed(build)
        encoder = PAN2TextEncoder(tokenizer, model)
        encoder.encode(PROMPTS[0])  # first-call set-up out of the timing
        outs, encode_s = _timed(lambda encoder=encoder: [encoder.encode(p).features for p in PROMPTS])
        features[name] = [f.float().cpu() for f in outs]
        report["seconds"][name] = {"load": round(load_s, 2), "encode_both": round(encode_s, 3)}
        print(
            f"{name}: load {load_s:.2f} s, encode {len(PROMPTS)} prompts {encode_s * 1000:.1f} ms", flush=True
        )
        del encoder, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    reference = features["pan2 float32"]
    for name in ("pan2 bf16", "transformers bf16"):
        report["errors"][f"{name} vs pan2 float32"] = [
            _errors(f, r) for f, r in zip(features[name], reference)
        ]
    report["errors"]["pan2 bf16 vs transformers bf16"] = [
        _errors(f, r) for f, r in zip(features["pan2 bf16"], features["transformers bf16"])
    ]
    for name, rows in report["errors"].items():
        print(name, ", ".join(f"rms {r['relative_rms']:.4f} cos {r['cosine']:.6f}" for r in rows))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
