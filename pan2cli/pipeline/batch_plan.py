"""What a generation was asked for (`BatchRequest`: a prompt or a prompt file, a preset and the settings given over it,
the outputs) → this process's checked `GenerationJob`s, the records that cannot run, and the run-time options
resolved and checked (`prepare_batch`), all before any model loads.

`pan2 generate` and `VideoGenerator.generate_file` plan here (`pan2cli.pipeline.batch_run` runs the plan).
torch-free at import: the CLI checks a row split in pan2's launcher before it imports torch-bound modules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from pan2cli.config import RuntimeConfig, given_settings, runtime_given, runtime_with, settings_with
from pan2cli.constants import MAX_FRAMES
from pan2cli.errors import InputError, Pan2Error
from pan2cli.outputs import DEFAULT_CRF, check_not_stdout
from pan2cli.pipeline.chains import PlannedRecord, link_rounds
from pan2cli.pipeline.jobs import Chain, GenerationJob, latents_path_for
from pan2cli.pipeline.prompts import read_prompt_file, shard, slugify
from pan2cli.presets import DEFAULT_PRESET, Preset, load_preset, preset_label

# The flag that gives each setting, for the sidecar's `overrides` (`--size` gives two; the others are `--NAME`).
_FLAGS = {
    "height": "--size",
    "width": "--size",
    "flow_shift": "--flow-shift",
    "negative_prompt": "--negative-prompt",
    "chunk_latent_frames": "--chunk-latent-frames",
}


class JobPlan(NamedTuple):
    """This process's share of the command: the jobs to make, the records that cannot run (each an error naming the
    file and the record; a round whose chain stopped before it too), the outputs skipped as existing, warnings,
    whether it is a batch, and the chains whose rounds all exist but whose stitched video does not."""

    jobs: list[GenerationJob]
    failures: list[Pan2Error]
    skipped: list[Path]
    warnings: list[str]
    batch: bool
    stitch: tuple[Chain, ...] = ()


def overrides(flags: Mapping[str, Any], record=None, runtime_flags: Mapping[str, Any] | None = None) -> dict:
    """The settings given over the preset as `settings_with` applies them, each with where it came from (its
    flag, or the prompt-file record): `{"seed": {"value": 7, "from": "record"}, "steps": {"value": 2, "from":
    "--steps"}}`; paths absolute. `runtime_flags` are the flags that replace a preset's run-time keys
    (`precision`, `chunk_latent_frames`): with them, preset + overrides rebuild the run."""
    layers = (flags, record.settings() if record is not None else {})
    given = {
        name: {
            "value": os.path.abspath(value) if isinstance(value, Path) else value,
            "from": _FLAGS.get(name, f"--{name}") if layer == 0 else "record",
        }
        for name, (layer, value) in given_settings(*layers).items()
        if name != "prompt"
    }
    for name, value in (runtime_flags or {}).items():
        given[name] = {"value": value, "from": _FLAGS.get(name, f"--{name}")}
    return given


def _output_folder(output: str | None) -> Path:
    """The folder a prompt file's videos go to (`-o`, else the current folder), which must exist."""
    folder = Path(output) if output is not None else Path.cwd()
    if folder.is_dir():
        return folder
    named_file = not str(output).endswith(("/", os.sep)) and folder.suffix.lower() == ".mp4"
    if named_file or folder.is_file():  # `-o file.mp4`: a folder is needed, not a file
        raise InputError(
            f"-o {folder}: with --prompts, -o is the folder the videos go to (NNN_<name>.mp4 each), not a file",
            hint="pass an existing folder, e.g. -o videos/ after mkdir videos",
        )
    raise InputError(
        f"-o {folder}: with --prompts, -o is an existing folder", hint=f"create it first (mkdir -p {folder})"
    )


def plan_jobs(
    prompt: str | None,
    prompts_file: Path | None,
    output: str | None,
    preset: Preset,
    flags: Mapping[str, Any],
    *,
    save_latents: bool = False,
    overwrite: bool = False,
    skip_existing: bool = False,
    crf: int = DEFAULT_CRF,
    max_frames: int | None = MAX_FRAMES,
    runtime_flags: Mapping[str, Any] | None = None,
    continue_from: Path | None = None,
    world: int = 1,
    rank: int = 0,
) -> JobPlan:
    """This rank's jobs of a command; everything checked, nothing loaded. A prompt-file record that cannot run is
    a failure of its own (an InputError naming the file and the record), reported while the others run; a bad
    flag or file is the command's error.

    Args:
        prompt / prompts_file: one of them.
        output: `-o` as typed: a file for one prompt (or a folder, `<slug>.mp4` in it), a folder for a file.
        preset, flags: the settings (`settings_with`; a record's fields over the flags).
        max_frames: the longest video accepted (`--max-frames`).
        runtime_flags: the flags given for a preset's run-time keys, recorded in the sidecar's `overrides`.
        continue_from: the video the first round of each chain continues (`--continue-from`: an MP4 or a latents
            file); records that continue each other are chains (`pan2cli.pipeline.chains`).
        world, rank: a prompt file's chains are shared by the ranks (`shard`).

    Raises:
        InputError: both or neither of prompt and prompts_file, an unreadable prompt file, a bad flag, an output
            that cannot be one, `--skip-existing` with `--overwrite`, a `--continue-from` that cannot be read (or
            with `--image`, or of another size).
    """
    if skip_existing and overwrite:
        raise InputError(
            "--skip-existing keeps the videos that exist and --overwrite replaces them: pass one of them"
        )
    warnings: list[str] = []
    check_not_stdout(output)
    if prompts_file is not None:
        if prompt is not None:
            raise InputError("give a PROMPT or --prompts FILE, not both")
        records, warnings = read_prompt_file(prompts_file)
        folder = _output_folder(output)
        settings_with(preset, flags)  # the flags alone: a bad one is every record's, the command's error
        entries = [(r, folder / f"{r.stem}.mp4") for r in shard(records, rank, world)]
    else:
        if prompt is None:
            raise InputError(
                "no prompt",
                hint='pass the text, e.g. pan2 generate "a red fox in the snow", or --prompts FILE',
            )
        if output is not None and (output.endswith(("/", os.sep)) or Path(output).is_dir()):
            if not Path(output).is_dir():  # a trailing slash names a folder, never a file
                raise InputError(
                    f"-o {output}: the folder does not exist", hint=f"create it first (mkdir -p {output})"
                )
            output = Path(output) / f"{slugify(prompt)}.mp4"
        entries = [(None, Path(output) if output is not None else Path.cwd() / f"{slugify(prompt)}.mp4")]
    source = None
    if continue_from is not None:
        from pan2cli.pipeline.chain_frames import read_start_video  # torch, as the generation that follows

        if flags.get("image") is not None:
            raise InputError("--image and --continue-from both give the first frame: pass one of them")
        source = read_start_video(Path(continue_from))
    label = preset_label(preset)
    planned = []
    for record, out in entries:
        origin = f"{prompts_file}: prompt {record.index} ({record.stem})" if record is not None else None
        entry = PlannedRecord(record, out, origin)
        planned.append(entry)
        if record is not None and record.problem is not None:
            entry.problem = record.problem
            continue
        if out.suffix.lower() != ".mp4":
            raise InputError(f"-o {out}: pan2 generate writes MP4 files (.mp4)")
        # A round that continues a video starts from its last frame, not from --image.
        given = {k: v for k, v in flags.items() if k != "image"} if record and record.continues else flags
        metadata = {"preset": label, "overrides": overrides(given, record, runtime_flags)}
        if record is not None:
            metadata.update(prompts_file=os.path.abspath(prompts_file), index=record.index, name=record.name)
        try:
            if source is not None and record is not None and record.image is not None:
                raise InputError("'image' and --continue-from both give the first frame: drop one of them")
            entry.settings = settings_with(
                preset, {**given, "prompt": prompt}, record.settings() if record else {}
            )
            if not (skip_existing and out.exists()):
                entry.job = GenerationJob(
                    entry.settings, output=out, latents_path=latents_path_for(out) if save_latents else None,
                    overwrite=overwrite, crf=crf, return_frames=False, metadata=metadata, redo_leftovers=skip_existing,
                    skip_existing=skip_existing, origin=origin, max_frames=max_frames,
                    flow_shift_source="--flow-shift" if "flow_shift" in flags else f"preset {label}",
                )  # fmt: skip
        except InputError as exc:
            if record is None and not (skip_existing and out.exists()):
                raise
            entry.problem = InputError(f"{origin}: {exc}", hint=exc.hint)
        if skip_existing and out.exists():  # made before: skipped whatever its settings now
            entry.skipped, entry.problem = True, None
    linked = link_rounds(planned, source, skip_existing=skip_existing)
    jobs = [e.job for e in planned if e.job is not None and id(e.job) not in linked.not_made]
    failures = [e.problem for e in planned if e.problem is not None] + linked.failures
    skipped = [e.output for e in planned if e.skipped]
    return JobPlan(jobs, failures, skipped, warnings, prompts_file is not None, tuple(linked.stitch))


@dataclass(frozen=True)
class BatchRequest:
    """What to generate, as `pan2 generate` takes it (its options but the run-time ones, `RuntimeConfig`).

    Attributes:
        prompt / prompts_file: one prompt, or a prompt file (JSON, JSON Lines, text: `pan2cli.pipeline.prompts`).
        output: `-o` as typed: a file for one prompt (or a folder, `<slug>.mp4` in it), an existing folder for a
            prompt file; None: the current folder.
        preset: a preset name, `.toml` path or `Preset`.
        settings: the settings given over the preset (`GenerationSettings` fields and `duration`; a record's win).
        save_latents, overwrite, skip_existing, crf, max_frames, continue_from: as `plan_jobs` takes them.
    """

    prompt: str | None = None
    prompts_file: Path | None = None
    output: str | os.PathLike | None = None
    preset: str | os.PathLike | Preset = DEFAULT_PRESET
    settings: Mapping[str, Any] = field(default_factory=dict)
    save_latents: bool = False
    overwrite: bool = False
    skip_existing: bool = False
    crf: int = DEFAULT_CRF
    max_frames: int | None = MAX_FRAMES
    continue_from: Path | None = None

    def resolve_preset(self) -> Preset:
        """The preset, read (a name or path) or as given."""
        return self.preset if isinstance(self.preset, Preset) else load_preset(self.preset)


@dataclass(frozen=True)
class PreparedBatch:
    """A request checked before any model loads: its preset, the run-time options resolved (`runtime_with`), this
    process's `JobPlan`, and the warnings to say once (rank 0)."""

    preset: Preset
    runtime: RuntimeConfig
    plan: JobPlan
    warnings: tuple[str, ...]


def prepare_batch(
    request: BatchRequest, given: RuntimeConfig, *, world: int = 1, rank: int = 0
) -> PreparedBatch:
    """Everything about `request` that can be checked before any model loads: the jobs of this rank (`plan_jobs`;
    a prompt file's records are shared by the ranks), the run-time options for this machine (`check_run_options`),
    a single video's rows against a decode split over the ranks.

    Args:
        request: what to generate.
        given: the run-time options as given (`precision` and `chunk_latent_frames` None: the preset's).
        world, rank: this process among the torchrun's.

    Raises:
        InputError: as `plan_jobs`, `check_run_options` and `check_decode_split` (the command's error; a record's
            own problem is in `plan.failures`).
        Pan2Error: no usable ffmpeg.
    """
    from pan2cli import distributed
    from pan2cli.pipeline.run_checks import check_run_options, precision_source

    preset = request.resolve_preset()
    runtime = runtime_with(preset, given)
    sharded = request.prompts_file is not None
    output = os.fspath(request.output) if request.output is not None else None
    plan = plan_jobs(
        request.prompt, request.prompts_file, output, preset, request.settings, save_latents=request.save_latents,
        overwrite=request.overwrite, skip_existing=request.skip_existing, crf=request.crf,
        max_frames=request.max_frames, runtime_flags=runtime_given(given), continue_from=request.continue_from,
        world=world if sharded else 1, rank=rank if sharded else 0,
    )  # fmt: skip
    device = check_run_options(runtime, precision_from=precision_source(preset, given))
    if world > 1 and distributed.env_local_world_size(world) == world:  # the generator's rule for a row split
        check_decode_split(request, runtime, world)
    warnings = list(plan.warnings)
    if runtime.offload and device.type == "cpu":
        warnings.append(
            "--offload changes nothing on the CPU: it streams the transformer's blocks from host memory to a GPU, "
            "and on the CPU they are in host memory already"
        )
    if runtime.max_gpu_memory_gib is not None and device.type == "cpu":
        warnings.append("--max-gpu-memory changes nothing on the CPU: it caps what a run may use of a GPU")
    return PreparedBatch(preset, runtime, plan, tuple(warnings))


def check_decode_split(request: BatchRequest, runtime: RuntimeConfig, world: int) -> None:
    """One prompt on `world` processes of one machine is decoded split by rows (`decode_kernel_parallel`): its video
    needs a latent row (16 pixels) per process. Checked in pan2's launcher before any process starts, and on each
    rank (a user's own torchrun).

    Raises:
        InputError: fewer latent rows than processes.
    """
    if request.prompts_file is not None or request.prompt is None or not runtime.decode_kernel_parallel:
        return
    settings = settings_with(request.resolve_preset(), {**request.settings, "prompt": request.prompt})
    rows = settings.latent_shape[-2]
    if rows < world:
        raise InputError(
            f"a video {settings.height} pixels high has {rows} latent rows, too few to split its decode "
            f"over {world} processes (one row each at least)",
            hint=f"pass --gpus {rows} or fewer, a larger --size, or --no-decode-kernel-parallel",
        )
