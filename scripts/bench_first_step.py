"""Time from `pan2 generate` to its first denoising step, and the transformer's load rate beside safetensors'.

Two measurements on a PAN 2 repository (full size: `scripts/make_random_pan2.py`; any other for a dry run):

1. `pan2 generate` as a fresh process per precision (`--precision bf16 fp8`), one step, its sidecar read back:
   command start → first denoising step (`time_to_first_step`), the loads and whether they overlapped.
2. `--load-rate`: the transformer's shards read to the device by pan2's loader (`load_pan2_transformer`) and
   by a plain `safetensors.torch.load_file` of each shard, in MB/s of file bytes, from a warm page cache and,
   with `--cold`, from cold files (each shard dropped from the page cache first with
   `posix_fadvise(DONTNEED)`, which needs no root; pages of files another process holds mapped may stay).

Packages should be byte-compiled first (`python3 -m compileall -q` over site-packages) so that the start-up is a
user's, not Python's first compile.

    python3 scripts/bench_first_step.py --model /tmp/pan2full --precision bf16 fp8 --load-rate --cold
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a PAN 2 repository folder")
    parser.add_argument("--precision", nargs="+", default=["bf16"], choices=["bf16", "fp8"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="704x1248")
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument(
        "--cold", action="store_true", help="also from cold files (dropped from the page cache)"
    )
    parser.add_argument(
        "--load-rate", action="store_true", help="the transformer's load rate beside safetensors'"
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args(argv)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (clean pages go; no root needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def transformer_files(model: Path) -> list[Path]:
    return sorted((model / "transformer").glob("*.safetensors"))


def generate_once(args, precision: str, cold: bool, workdir: Path) -> dict:
    """One `pan2 generate` in a fresh process; its wall time and what its sidecar says of the loads."""
    if cold:
        drop_from_page_cache(transformer_files(args.model))
    out = workdir / f"first-step-{precision}-{'cold' if cold else 'warm'}.mp4"
    command = [
        sys.executable, "-m", "pan2cli", "generate", "a red fox runs through the snow at dawn",
        "--model", str(args.model), "--preset", "pan2-5s", "--steps", "1", "--frames", str(args.frames),
        "--size", args.size, "--device", args.device, "--precision", precision, "-o", str(out), "--overwrite",
    ]  # fmt: skip
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    begin = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        return {"precision": precision, "cold": cold, "error": proc.stderr.strip().splitlines()[-1:]}
    side = json.loads(out.with_suffix(".json").read_text())
    return {
        "precision": precision,
        "cold": cold,
        "wall_s": round(wall, 2),
        "time_to_first_step_s": side["time_to_first_step"],
        "from": side["time_to_first_step_from"],
        "seconds": side["seconds"],
        "shared_loads": side["shared_loads"],
        "notes": [line for line in proc.stderr.splitlines() if line.startswith(("Loading", "Note"))],
    }


def load_rates(args, cold: bool) -> dict:
    """MB/s of file bytes: pan2's loader (the whole model to the device) and safetensors' load_file per shard."""
    import torch
    from safetensors.torch import load_file

    from pan2cli.dit.checkpoint import load_pan2_transformer

    files = transformer_files(args.model)
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rates = {"file_mb": round(size_mb), "cold": cold}
    for name in ("pan2", "safetensors"):
        if cold:
            drop_from_page_cache(files)
        begin = time.perf_counter()
        if name == "pan2":
            model = load_pan2_transformer(args.model, device=device)
            sync()
            del model
        else:
            for path in files:
                tensors = load_file(str(path), device=str(device))
                sync()
                del tensors
        seconds = time.perf_counter() - begin
        rates[f"{name}_s"] = round(seconds, 2)
        rates[f"{name}_mb_per_s"] = round(size_mb / seconds)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rates


def main(argv=None) -> None:
    args = parse_args(argv)
    results = {"model": str(args.model), "runs": [], "load_rates": []}
    temperatures = [False, True] if args.cold else [False]
    with tempfile.TemporaryDirectory(prefix="pan2-first-step-") as folder:
        for precision in args.precision:
            generate_once(args, precision, False, Path(folder))  # warms the kernel caches and the page cache
            for cold in temperatures:
                run = generate_once(args, precision, cold, Path(folder))
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
    if args.load_rate:
        for cold in temperatures:
            rates = load_rates(args, cold)
            results["load_rates"].append(rates)
            print(json.dumps(rates), flush=True)
    print(
        "\n| precision | cache | command → first step s | wall s | load transformer s (waited) | text encoder s |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for run in results["runs"]:
        if "error" in run:
            print(
                f"| {run['precision']} | {'cold' if run['cold'] else 'warm'} | error: {run['error']} | | | |"
            )
            continue
        load = run["shared_loads"].get("load_transformer", {})
        text = run["shared_loads"].get("load_text_encoder", {}).get("seconds")
        print(
            f"| {run['precision']} | {'cold' if run['cold'] else 'warm'} | {run['time_to_first_step_s']} | {run['wall_s']} "
            f"| {load.get('seconds')} ({load.get('waited', 'not overlapped')}) | {text} |"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
