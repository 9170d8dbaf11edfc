"""`pan2 decode` as users run it: a fresh process each time, against the in-process steady state.

Usage: python scripts/bench_cli.py [--latent-frames 31 121] [--latent-size 44x78] [--gpus 1 2]
       [--formats pt mp4] [--runs 3] [--no-cold] [--device cuda|cpu] [--tiny] [--timeout 600]
       [--workdir DIR] [--keep] [--out results.json]

Inputs, built in the work folder: a random full-size Wan2.2 VAE as a diffusers folder
(`pan2cli.testing.tiny_pan2`'s `write_vae`; `--tiny`: its tiny config, for a CPU check) and random latents
[1, 48, T, H, W] as `.pt` files, one per `--latent-frames` value T (default 31 and 121: 5 s and 20 s of
video at 24 fps), H x W from `--latent-size` (default 44x78: 704x1248 pixels).

Measured, every child with the parent's environment plus PYTHONUNBUFFERED=1 and a `--timeout`:
- the floor: a fresh `python -c "import torch; torch.zeros(1, device='cuda')"` (one untimed warm-up, then
  `--runs`);
- `python -m pan2cli decode LAT --vae VAE -o OUT --overwrite [--gpus N]` for every latent length x `--gpus`
  value x `--formats` value: one untimed warm-up (kernel and Triton caches warm), then `--runs` timed runs.
  Per run: the wall seconds around the child, and the figures of the CLI's stderr summary (`decode X s`,
  `total X s`, `first frame after X s`; None where this version of the CLI does not print them);
- in-process steady state of the same latents: the decoder loaded as the CLI loads it
  (`load_vae_decoder`, `select_decode_path`, every rank agreeing on the path), `decode_latents` without a
  writer, median `DecodeStats.seconds` (device-synchronised) of `--runs` after one warm-up; in a child
  process (this script with `--in-process-worker`), under torchrun for 2 GPUs;
- cold caches (`--cold`, on by default), first latent length, 1 GPU, pt: with `PAN2_CACHE_DIR` and
  `TRITON_CACHE_DIR` fresh and empty, (a) one decode (kernel build included), then (b) with another
  fresh pair, `python -m pan2cli kernels build` (not on the CPU: there is no kernel) and `--runs` decodes:
  the first decode against the median of the later ones (target: within 10 %).

A decode that exits non-zero stops the benchmark with its stderr. `--device cpu` checks the script on a
machine without a GPU (`--device cpu --dtype fp32` passed to the CLI; `--gpus 2` runs two gloo processes).
Prints a markdown table last; `--out` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKER_FLAG = "--in-process-worker"
CLI_FIGURES = {
    "decode": re.compile(r"decode (\d+(?:\.\d+)?) s"),
    "total": re.compile(r"total (\d+(?:\.\d+)?) s"),
    "first_frame": re.compile(r"first frame after (\d+(?:\.\d+)?) s"),
}


# -- arguments ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--latent-frames",
        type=int,
        nargs="+",
        default=[31, 121],
        help="Latent frames T, one latents file each.  [default: 31 121]",
    )
    parser.add_argument(
        "--latent-size",
        default="44x78",
        help="Latent H x W (16x in pixels).  [default: 44x78, 704x1248 pixels]",
    )
    parser.add_argument(
        "--gpus", type=int, nargs="+", default=[1, 2], help="GPU counts (1: no --gpus flag).  [default: 1 2]"
    )
    parser.add_argument(
        "--formats",
        nargs="+",
        choices=("pt", "mp4"),
        default=["pt", "mp4"],
        help="Output formats.  [default: pt mp4]",
    )
    parser.add_argument("--runs", type=int, default=3, help="Timed runs after the warm-up.  [default: 3]")
    parser.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Also time decodes with empty kernel and Triton caches.  [default: on]",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: check the script without a GPU.  [default: cuda]",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="The tiny VAE config of pan2cli.testing.tiny_pan2 instead of the full size (a CPU check).",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Seconds each child process may run.  [default: 600]"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the VAE weights and the latents.  [default: 0]"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="Build the inputs here (kept).  [default: a fresh temporary folder]",
    )
    parser.add_argument("--keep", action="store_true", help="Keep the temporary work folder (printed).")
    parser.add_argument("--out", default=None, help="Also write the results as JSON here.")
    args = parser.parse_args(argv)
    match = re.fullmatch(r"(\d+)x(\d+)", args.latent_size)
    if not match:
        parser.error("--latent-size must be HxW, e.g. 44x78")
    args.latent_hw = (int(match[1]), int(match[2]))
    if args.runs < 1 or min(args.gpus) < 1 or min(args.latent_frames) < 1:
        parser.error("--runs, --gpus and --latent-frames must be ≥ 1")
    if args.workdir is not None and (args.workdir / "vae").exists():
        parser.error(f"--workdir {args.workdir} already holds a vae/ folder: pass an empty or new folder")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (pass --device cpu to check the script)")
    return args


# -- inputs ---------------------------------------------------------------------------------------
def build_inputs(workdir: Path, args: argparse.Namespace) -> tuple[Path, dict[int, Path]]:
    """Write the random VAE (diffusers folder) and one latents file per T; returns the VAE folder and {T: path}."""
    from pan2cli.testing.tiny_pan2 import TINY_VAE, write_vae
    from pan2cli.vae.config import WanVAEConfig

    vae = workdir / "vae"
    write_vae(vae, args.seed, TINY_VAE if args.tiny else WanVAEConfig())
    generator = torch.Generator().manual_seed(args.seed + 1)
    latents = {}
    for t in args.latent_frames:
        latents[t] = workdir / f"latents_t{t}.pt"
        torch.save(torch.randn((1, 48, t, *args.latent_hw), generator=generator), latents[t])
    return vae, latents


# -- child processes ------------------------------------------------------------------------------
def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment (PYTHONPATH and the rest), unbuffered, plus `extra`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def run_child(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[float, str, str]:
    """Run `cmd` to its end; returns (wall seconds, stdout, stderr). Stops the benchmark if it fails.

    The child gets its own process group, so a timeout also ends what it started (torchrun's workers).
    """
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:  # the timeout, or Ctrl-C here
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stderr = proc.communicate()[1]
        if isinstance(exc, subprocess.TimeoutExpired):
            print(f"stopped after --timeout {timeout:g} s: {' '.join(cmd)}\n{stderr}", file=sys.stderr)
            raise SystemExit(1) from None
        raise
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"exit code {proc.returncode}: {' '.join(cmd)}\n{stderr}", file=sys.stderr)
        raise SystemExit(1)
    return seconds, stdout, stderr


def cli_figures(stderr: str) -> dict[str, float | None]:
    """The seconds the CLI's last summary line reports (None for a figure it does not print)."""
    figures = {}
    for name, pattern in CLI_FIGURES.items():
        found = pattern.findall(stderr)
        figures[name] = float(found[-1]) if found else None
    return figures


def spread(values: list[float | None]) -> dict[str, float | None]:
    """min and median of `values`, None where any is missing."""
    if not values or any(v is None for v in values):
        return {"min": None, "median": None}
    return {"min": min(values), "median": statistics.median(values)}


# -- the measurements -----------------------------------------------------------------------------
def measure_floor(args: argparse.Namespace) -> dict:
    """Wall seconds of a fresh Python that imports torch and touches the device (one warm-up, then `--runs`)."""
    device = "'cuda'" if args.device == "cuda" else "'cpu'"
    cmd = [sys.executable, "-c", f"import torch; torch.zeros(1, device={device})"]
    seconds = [run_child(cmd, child_env(), args.timeout)[0] for _ in range(1 + args.runs)][1:]
    return {"command": cmd, "wall_s": seconds, **spread(seconds)}


def decode_command(args: argparse.Namespace, vae: Path, latents: Path, output: Path, gpus: int) -> list[str]:
    """`python -m pan2cli decode` as a user would type it for this case."""
    cmd = [
        sys.executable,
        "-m",
        "pan2cli",
        "decode",
        str(latents),
        "--vae",
        str(vae),
        "-o",
        str(output),
        "--overwrite",
    ]
    if args.device == "cpu":
        cmd += ["--device", "cpu", "--dtype", "fp32"]
    if gpus > 1:
        cmd += ["--gpus", str(gpus)]
    return cmd


def timed_decodes(cmd: list[str], env: dict[str, str], runs: int, timeout: float) -> list[dict]:
    """`runs` fresh-process decodes: wall seconds and the CLI's own figures of each."""
    results = []
    for _ in range(runs):
        wall, _, stderr = run_child(cmd, env, timeout)
        results.append({"wall_s": wall, **cli_figures(stderr)})
    return results


def summarize_runs(runs: list[dict]) -> dict:
    """min and median of the wall seconds and of each CLI figure over `runs`."""
    return {key: spread([run[key] for run in runs]) for key in ("wall_s", *CLI_FIGURES)}


def measure_cli(
    args: argparse.Namespace, vae: Path, latents: dict[int, Path], gpu_counts: list[int], outdir: Path
) -> list[dict]:
    """One row per (T, GPUs, format): an untimed warm-up, then `--runs` timed fresh-process decodes."""
    rows = []
    for t, path in latents.items():
        for gpus in gpu_counts:
            for fmt in args.formats:
                cmd = decode_command(args, vae, path, outdir / f"t{t}_gpus{gpus}.{fmt}", gpus)
                print(f"pan2 decode: T={t}, {gpus} GPU(s), {fmt} …", flush=True)
                run_child(cmd, child_env(), args.timeout)  # warm-up
                runs = timed_decodes(cmd, child_env(), args.runs, args.timeout)
                rows.append(
                    {
                        "latent_frames": t,
                        "gpus": gpus,
                        "format": fmt,
                        "command": cmd,
                        "runs": runs,
                        **summarize_runs(runs),
                    }
                )
                print(
                    f"  {json.dumps(runs)}", flush=True
                )  # as it comes: a run cut short keeps what it measured
    return rows


def measure_in_process(
    args: argparse.Namespace, vae: Path, latents: dict[int, Path], gpus: int, workdir: Path
) -> dict:
    """Steady-state decode seconds per T in one process (or `gpus` ranks under torchrun): this script as
    `--in-process-worker`, in a child so that this process holds no model or GPU memory."""
    report = workdir / f"in_process_gpus{gpus}.json"
    worker_args = [
        WORKER_FLAG,
        "--device",
        args.device,
        "--vae",
        str(vae),
        "--runs",
        str(args.runs),
        "--report",
        str(report),
    ]
    worker_args += ["--latents", *(str(p) for p in latents.values())]
    env = child_env()
    if gpus == 1:
        cmd = [sys.executable, __file__, *worker_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(gpus),
            __file__,
            *worker_args,
        ]
        # As `pan2 decode --gpus N` does: CPU ranks share the cores (torchrun alone would give each 1 thread).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // gpus)))
    print(f"in-process steady state: {gpus} GPU(s) …", flush=True)
    run_child(cmd, env, args.timeout)
    result = json.loads(report.read_text())
    result["latents"] = {int(t): value for t, value in result["latents"].items()}
    return result


def measure_cold(args: argparse.Namespace, vae: Path, t: int, latents: Path, workdir: Path) -> dict:
    """Decodes with empty kernel and Triton caches: one straight away, then `kernels build` and `--runs` decodes."""

    def fresh_caches(name: str) -> dict[str, str]:
        folder = workdir / "cold-caches" / name
        (folder / "pan2").mkdir(parents=True)
        (folder / "triton").mkdir()
        return child_env(PAN2_CACHE_DIR=str(folder / "pan2"), TRITON_CACHE_DIR=str(folder / "triton"))

    cmd = decode_command(args, vae, latents, workdir / "out" / "cold.pt", 1)
    print("cold caches: one decode …", flush=True)
    empty = timed_decodes(cmd, fresh_caches("empty"), 1, args.timeout)[0]
    print(f"  {json.dumps(empty)}", flush=True)
    env = fresh_caches("after-build")
    build_s = None
    if args.device == "cuda":
        print("cold caches: pan2 kernels build …", flush=True)
        build_s = run_child([sys.executable, "-m", "pan2cli", "kernels", "build"], env, args.timeout)[0]
        print(f"  {build_s:.2f} s", flush=True)
    print(f"cold caches: {args.runs} decode(s) after the build …", flush=True)
    after = timed_decodes(cmd, env, args.runs, args.timeout)
    print(f"  {json.dumps(after)}", flush=True)
    later = summarize_runs(after[1:]) if len(after) > 1 else None
    ratios = {}
    for key in ("wall_s", "decode"):
        first, rest = after[0][key], later[key]["median"] if later else None
        ratios[key] = first / rest if first is not None and rest else None
    return {
        "latent_frames": t,
        "empty_caches": empty,
        "kernels_build_s": build_s,
        "after_build": after,
        "later_median": later,
        "first_over_later": ratios,
    }


# -- the in-process worker (a child of the benchmark, under torchrun for several GPUs) ------------
def worker_main(argv: list[str]) -> None:
    """Load the decoder as `pan2 decode` does, time `decode_latents` (no writer) per latents file; rank 0 writes --report."""
    parser = argparse.ArgumentParser(prog=f"bench_cli.py {WORKER_FLAG}")
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--vae", required=True)
    parser.add_argument("--latents", nargs="+", required=True)
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--report", required=True)
    args = parser.parse_args(argv)

    from pan2cli import distributed
    from pan2cli.vae.checkpoint import load_vae_decoder
    from pan2cli.vae.decoder import decode_latents
    from pan2cli.vae.kernel.choice import select_decode_path
    from pan2cli.vae.kernel.decoder import WanKernelDecoder

    group = (
        distributed.process_group(args.device)
        if distributed.under_torchrun()
        else nullcontext(torch.device(args.device))
    )
    with group as device:
        start = time.perf_counter()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        reference = load_vae_decoder(args.vae, None, dtype=dtype, device=device)
        decoder, note = select_decode_path(reference)
        if not distributed.agree_all(
            decoder is not reference
        ):  # every rank takes the same path, as in the CLI
            decoder = reference
        del reference
        load_s = time.perf_counter() - start
        results = {}
        for path in args.latents:
            z = torch.load(path, weights_only=True)[0]
            seconds = [decode_latents(decoder, z, None).seconds for _ in range(1 + args.runs)][1:]
            results[z.shape[1]] = {"seconds": seconds, "median_s": statistics.median(seconds)}
        if distributed.is_main():
            path = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference decoder"
            report = {
                "ranks": distributed.world_size(),
                "decode_path": path,
                "note": note,
                "load_s": load_s,
                "latents": results,
            }
            Path(args.report).write_text(json.dumps(report, indent=2))


# -- the report -----------------------------------------------------------------------------------
def _s(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def print_report(results: dict) -> None:
    """The header lines, the floor, one table row per case, the cold-cache figures."""
    floor = results["floor"]
    print()
    print(
        f"{results['date']} on {results['device_name']}; torch {results['torch']}; VAE {results['vae']}; latents 48 x T x {results['latent_size']}"
    )
    print(
        f"floor (fresh `{floor['command'][-1]}`): min {_s(floor['min'])} s, median {_s(floor['median'])} s over {len(floor['wall_s'])} runs"
    )
    for note in results["notes"]:
        print(f"note: {note}")
    for gpus, value in results["in_process"].items():
        print(
            f"in-process ({gpus} GPU(s)): {value['decode_path']}, loaded in {value['load_s']:.1f} s"
            + (f"; {value['note']}" if value["note"] else "")
        )
    print()
    print(
        "| latent frames | GPUs | format | runs | wall min s | wall median s | CLI decode min s | CLI decode median s "
        "| CLI total median s | CLI first frame median s | in-process decode s | CLI decode / in-process "
        "| wall − (floor + in-process) s |"
    )
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in results["rows"]:
        steady = (
            results["in_process"]
            .get(row["gpus"], {})
            .get("latents", {})
            .get(row["latent_frames"], {})
            .get("median_s")
        )
        decode = row["decode"]["median"]
        ratio = decode / steady if decode is not None and steady else None
        overhead = row["wall_s"]["median"] - (floor["median"] + steady) if steady is not None else None
        print(
            f"| {row['latent_frames']} | {row['gpus']} | {row['format']} | {len(row['runs'])} "
            f"| {_s(row['wall_s']['min'])} | {_s(row['wall_s']['median'])} | {_s(row['decode']['min'])} | {_s(decode)} "
            f"| {_s(row['total']['median'])} | {_s(row['first_frame']['median'])} | {_s(steady, 3)} | {_s(ratio)}x | {_s(overhead)} |"
        )
    cold = results.get("cold")
    if cold:
        empty, ratios = cold["empty_caches"], cold["first_over_later"]
        later = cold["later_median"]
        print()
        print(f"cold caches (T={cold['latent_frames']}, 1 GPU, pt):")
        print(
            f"- empty caches: wall {_s(empty['wall_s'])} s, CLI decode {_s(empty['decode'])} s (kernel build included)"
        )
        print(
            f"- `pan2 kernels build`: {_s(cold['kernels_build_s'])} s"
            + ("" if cold["kernels_build_s"] is not None else " (skipped: no kernel on the CPU)")
        )
        first = cold["after_build"][0]
        print(
            f"- first decode after the build: wall {_s(first['wall_s'])} s, CLI decode {_s(first['decode'])} s; "
            f"later median: wall {_s(later['wall_s']['median'] if later else None)} s, "
            f"CLI decode {_s(later['decode']['median'] if later else None)} s; "
            f"first / later: wall {_s(ratios['wall_s'])}x, decode {_s(ratios['decode'])}x (target ≤ 1.10x)"
        )


def run_benchmark(args: argparse.Namespace, workdir: Path) -> dict:
    """Every measurement, in order; returns the results."""
    visible = torch.cuda.device_count() if args.device == "cuda" else None
    notes = []
    gpu_counts = []
    for gpus in dict.fromkeys(args.gpus):
        if visible is not None and gpus > visible:
            notes.append(f"--gpus {gpus} skipped: {visible} GPU(s) visible")
        else:
            gpu_counts.append(gpus)
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device_name": torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "vae": "tiny" if args.tiny else "full size",
        "latent_size": args.latent_size,
        "notes": notes,
    }
    print(f"{results['date']} on {results['device_name']}; work folder {workdir}", flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    print("building the inputs …", flush=True)
    vae, latents = build_inputs(workdir, args)
    (workdir / "out").mkdir(exist_ok=True)
    print("floor …", flush=True)
    results["floor"] = measure_floor(args)
    print(f"  {json.dumps(results['floor']['wall_s'])}", flush=True)
    results["rows"] = measure_cli(args, vae, latents, gpu_counts, workdir / "out")
    results["in_process"] = {
        gpus: measure_in_process(args, vae, latents, gpus, workdir) for gpus in gpu_counts
    }
    print(f"  {json.dumps(results['in_process'])}", flush=True)
    if args.cold:
        first = args.latent_frames[0]
        results["cold"] = measure_cold(args, vae, first, latents[first], workdir)
    return results


def main() -> None:
    if sys.argv[1:2] == [WORKER_FLAG]:
        worker_main(sys.argv[2:])
        return
    args = parse_args()
    temporary = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="bench_cli-")) if temporary else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        results = run_benchmark(args, workdir)
    finally:
        if temporary and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif temporary:
            print(f"kept the work folder {workdir}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print_report(results)


if __name__ == "__main__":
    main()
