"""Time from `pan2 generate` to its first denoising step, and the transformer's load rate beside safetensors'.

Two measurements on a PAN 2 repository (full size: `scripts/make_random_pan2.py`; any other for a dry run):

1. `pan2 generate` as a fresh process per precision (`--precision bf16 fp8`), one step, its sidecar read back:
   command start → first denoising step (`time_to_first_step`), the loads and whether they overlapped.
2. `--load-rate`: the transformer's shards read to the device by pan2's loader (`load_pan2_transformer`, with
   each of `--readers` reading threads) and by a plain `safetensors.torch.load_file` of each shard, and the
   text encoder by pan2's `load_text_model`, in MB/s of file bytes, from a warm page cache and, with
   `--cold`, from cold files (dropped from the page cache first with `posix_fadvise(DONTNEED)`, which needs
   no root; pages of files another process holds mapped may stay, and a tmpfs cannot be dropped: `cold_mb`
   says how many of the bytes were on a real disk).

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
    parser.add_argument(
        "--skip-warm-up", action="store_true", help="no untimed run first (fresh files are in the page cache)"
    )
    parser.add_argument(
        "--decode-kernel", default="auto", choices=["auto", "off"], help="passed to pan2 generate"
    )
    parser.add_argument(
        "--readers", type=int, nargs="+", default=[0], help="reading threads to try (0: pan2's default)"
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


def text_encoder_files(model: Path) -> list[Path]:
    return sorted((model / "text_encoder").glob("*.safetensors"))


def loaded_files(model: Path) -> list[Path]:
    """The files a cold run drops: the transformer's and the text encoder's."""
    return transformer_files(model) + text_encoder_files(model)


def on_tmpfs(path: Path) -> bool:
    """Whether `path` (links resolved) lives on a tmpfs, whose pages cannot be dropped (Linux; else False)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    target = str(path.resolve())
    point, kind = max(
        ((p, k) for p, k in mounts if target == p or target.startswith(p.rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=("", ""),
    )
    return kind == "tmpfs"


def cold_mb(paths: list[Path]) -> int:
    return round(sum(p.stat().st_size for p in paths if not on_tmpfs(p)) / 1e6)


def generate_once(args, precision: str, cold: bool, workdir: Path) -> dict:
    """One `pan2 generate` in a fresh process; its wall time and what its sidecar says of the loads."""
    if cold:
        drop_from_page_cache(loaded_files(args.model))
    out = workdir / f"first-step-{precision}-{'cold' if cold else 'warm'}.mp4"
    command = [
        sys.executable, "-m", "pan2cli", "generate", "a red fox runs through the snow at dawn",
        "--model", str(args.model), "--preset", "pan2-5s", "--steps", "1", "--frames", str(args.frames),
        "--size", args.size, "--device", args.device, "--precision", precision, "-o", str(out), "--overwrite",
        "--decode-kernel", args.decode_kernel,
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
        **({"cold_mb": cold_mb(loaded_files(args.model))} if cold else {}),
        "wall_s": round(wall, 2),
        "time_to_first_step_s": side["time_to_first_step"],
        "from": side["time_to_first_step_from"],
        "seconds": side["seconds"],
        "peak_gpu_memory_gib": side.get("peak_gpu_memory_gib"),
        "shared_loads": side["shared_loads"],
        "notes": [line for line in proc.stderr.splitlines() if line.startswith(("Loading", "Note"))],
    }


def load_rates(args, cold: bool) -> dict:
    """MB/s of file bytes: pan2's loader (the whole model to the device, per reader count), safetensors'
    load_file per shard, and pan2's text encoder load."""
    import torch
    from safetensors.torch import load_file

    from pan2cli.checkpoints import staged
    from pan2cli.dit.checkpoint import load_pan2_transformer
    from pan2cli.text.checkpoint import load_text_model

    files = transformer_files(args.model)
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    text_mb = sum(p.stat().st_size for p in text_encoder_files(args.model)) / 1e6
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rates = {"file_mb": round(size_mb), "text_encoder_mb": round(text_mb), "cold": cold}
    if cold:
        rates["cold_mb"] = cold_mb(loaded_files(args.model))
    default_readers = staged.READERS

    def timed(name: str, mb: float, load) -> None:
        if cold:
            drop_from_page_cache(loaded_files(args.model))
        begin = time.perf_counter()
        result = load()
        sync()
        seconds = time.perf_counter() - begin
        del result
        rates[f"{name}_s"] = round(seconds, 2)
        rates[f"{name}_mb_per_s"] = round(mb / seconds)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for readers in args.readers if not cold else [0]:  # the sweep from a warm cache only
        staged.READERS = readers or default_readers
        name = "pan2" if not readers else f"pan2_{readers}_readers"
        try:
            timed(name, size_mb, lambda: load_pan2_transformer(args.model, device=device))
        finally:
            staged.READERS = default_readers
    timed("safetensors", size_mb, lambda: [load_file(str(p), device=str(device)) for p in files][-1])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timed(
        "text_encoder",
        text_mb,
        lambda: load_text_model(args.model / "text_encoder", dtype=dtype, device=device),
    )
    return rates


def main(argv=None) -> None:
    args = parse_args(argv)
    results = {"model": str(args.model), "runs": [], "load_rates": []}
    temperatures = [False, True] if args.cold else [False]
    with tempfile.TemporaryDirectory(prefix="pan2-first-step-") as folder:
        for precision in args.precision:
            if not args.skip_warm_up:  # warms the kernel caches and the page cache
                generate_once(args, precision, False, Path(folder))
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
