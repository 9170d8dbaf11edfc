"""Which tensors are alive at the kernel decode's memory peak (one GPU, full-size random weights).

Usage: python scripts/diag_memory_peak.py [--latent-shape 1,48,9,44,78] [--tail-frames 2]

Records the caching allocator's history during one decode (after a warm-up), replays its alloc/free
events to find the moment of the largest allocated total, and prints the live blocks at that moment,
largest first, each with the innermost pan2cli line that allocated it.
"""

from __future__ import annotations

import argparse

import torch

from pan2cli.testing.random_weights import random_decoder
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.kernel.build import load_kernel
from pan2cli.vae.kernel.decoder import WanKernelDecoder


def _where(frames) -> str:
    for frame in frames:
        if "pan2cli" in frame["filename"]:
            return f"{frame['filename'].split('pan2cli/')[-1]}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latent-shape", default="1,48,9,44,78")
    parser.add_argument("--tail-frames", type=int, default=2)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.latent_shape.split(","))
    decoder = WanKernelDecoder(random_decoder(WanVAEConfig()), load_kernel(), tail_frames=args.tail_frames)
    torch.cuda.empty_cache()
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for _ in decoder.decode_uint8_chunks(z):  # warm-up
        pass
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    for _ in decoder.decode_uint8_chunks(z):
        pass
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")

    # Blocks alive before recording started (weights, histories) are in the segments but not the trace.
    live = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = (
                    block["size"],
                    _where(block.get("frames", [])) or "before recording",
                )
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    # Walk back from the end state to the state before the trace, then forward to the peak.
    for event in reversed(trace):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = (event["size"], _where(event["frames"]))
    start = dict(live)
    total = sum(size for size, _ in live.values())
    peak, peak_live, peak_index = total, dict(live), -1
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event["frames"]))
            total += event["size"]
            if total > peak:
                peak, peak_live, peak_index = total, dict(live), index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    print(f"peak of the replay {peak / 2**30:.2f} GiB at event {peak_index} of {len(trace)}")
    print(f"  blocks alive before the decode: {sum(s for s, _ in start.values()) / 2**30:.2f} GiB")
    by_site: dict[str, list[int]] = {}
    for address, (size, where) in peak_live.items():
        if address in start:
            where = "(before the decode) " + where
        by_site.setdefault(where, []).append(size)
    for where, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:25]:
        print(f"  {sum(sizes) / 2**30:6.3f} GiB in {len(sizes):4d} blocks  {where}")


if __name__ == "__main__":
    main()
