"""Rounds of a world: the records of a prompt file that continue each other (`"continue": true`, a `+` line) become
chains of jobs (`link_rounds`), each round an image-to-video job starting from the last frame of the round before it.

A chain's parts are the `--continue-from` video (if any) and its rounds, in order; its stitched MP4 holds them all,
each seam frame (a round's first frame stands where the part before it ends) once: F1 + F2 − 1 frames for two. Every
round writes its exact last frame beside its MP4 (`<name>.last.png`; an MP4 is lossy), so a rerun with
`--skip-existing` resumes a chain from its last finished round, from the same bytes. A round that cannot run (a bad
record, or one that fails) stops its chain: the rounds after it are not made, and say so.

Each round's sidecar says what it continued (`continues`: the video, the index of the frame it started from, and the
file holding that exact frame) and where its frames are in the stitched video (`chain`: round k's frame i, i ≥ 1 after
the first part, is the stitched video's frame `offset + i`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from pan2cli.config import GenerationSettings
from pan2cli.errors import InputError, Pan2Error
from pan2cli.pipeline.jobs import Chain, ChainRound, GenerationJob, RoundNotMade
from pan2cli.pipeline.prompts import PromptRecord

if TYPE_CHECKING:  # torch-free at import, as the planning that uses it (`pan2cli.pipeline.batch_plan`)
    from pan2cli.pipeline.chain_frames import StartVideo


@dataclass(eq=False)
class PlannedRecord:
    """A record of this rank (or the one prompt) as planned: its output and origin, and its job; or its settings
    when its video exists (`skipped`); or its `problem` when it cannot run."""

    record: PromptRecord | None
    output: Path
    origin: str | None = None
    job: GenerationJob | None = None
    settings: GenerationSettings | None = None
    skipped: bool = False
    problem: InputError | None = None


@dataclass
class LinkedRounds:
    """What `link_rounds` found: the jobs not to make (their chain stopped before them), their failures, and the
    chains whose rounds all exist but whose stitched video does not (made from the rounds' files alone)."""

    not_made: set[int] = field(default_factory=set)  # `id` of each job
    failures: list[Pan2Error] = field(default_factory=list)
    stitch: list[Chain] = field(default_factory=list)


def _groups(planned: list[PlannedRecord]) -> list[list[PlannedRecord]]:
    """Consecutive records that continue each other (`pan2cli.pipeline.prompts.chains`, on one rank's share)."""
    groups: list[list[PlannedRecord]] = []
    for entry in planned:
        if entry.record is not None and entry.record.continues and groups:
            groups[-1].append(entry)
        else:
            groups.append([entry])
    return groups


def link_rounds(
    planned: list[PlannedRecord], source: StartVideo | None, *, skip_existing: bool
) -> LinkedRounds:
    """Make each chain's jobs rounds (`GenerationJob.chain`, the sidecar's `continues` and `chain` in their
    metadata): a chain is records that continue each other, and the `--continue-from` video `source` before the first
    round of each.

    Raises:
        InputError: `source` is of another size than the videos it would continue into.
    """
    linked = LinkedRounds()
    for group in _groups(planned):
        if len(group) + (source is not None) < 2:
            continue  # a video of its own
        first = group[0].output
        chain = Chain(first.with_name(f"{first.stem}.chain.mp4"), [entry.output for entry in group], source)
        chain.write_stitched = not (skip_existing and chain.stitched.exists())
        _link_chain(chain, group, linked)
    return linked


def _link_chain(chain: Chain, group: list[PlannedRecord], linked: LinkedRounds) -> None:
    """One chain's rounds linked in order (`link_rounds`); from the first that cannot run, the rest not made."""
    from pan2cli.pipeline.chain_frames import last_frame_path

    source = chain.source
    before: PlannedRecord | None = None
    continues, offset = None, 0
    if source is not None:
        continues = {"video": os.path.abspath(source.path), "frame": source.frames - 1,
                     "frame_file": os.path.abspath(source.exact) if source.exact else None}  # fmt: skip
        offset = source.frames - 1
    stopped = None  # the round that stops the chain, once one cannot run
    made = False
    for position, entry in enumerate(group):
        settings = entry.job.settings if entry.job is not None else entry.settings
        if stopped is not None:
            if entry.job is not None:
                linked.not_made.add(id(entry.job))
                linked.failures.append(
                    RoundNotMade(f"{entry.origin} not made: it continues {stopped}, which cannot run")
                )
            continue
        # cannot run (or its video exists, made with settings that are no longer valid)
        if entry.problem is not None or settings is None:
            stopped = _label(entry)
            continue
        if source is not None and (settings.height, settings.width) != (source.height, source.width):
            raise InputError(
                f"--continue-from {source.path} is {source.height}x{source.width} pixels (HxW) and the videos "
                f"continuing it {settings.height}x{settings.width}: the stitched video needs one size",
                hint=f"pass --size {source.height}x{source.width}",
            )
        if entry.job is not None:
            made = True
            start_file = None
            if before is not None and before.skipped:  # made earlier: its exact last frame, else its MP4's
                png = last_frame_path(before.output)
                start_file = png if png.is_file() else before.output
                if continues is not None and not png.is_file():
                    continues["frame_file"] = None
            previous = before.job if before is not None else None
            entry.job.chain = ChainRound(chain, position, previous=previous, start_file=start_file)
            entry.job.metadata.update(
                continues=continues,
                chain={"video": os.path.abspath(chain.stitched), "round": position + 1, "rounds": len(group),
                       "offset": offset},
            )  # fmt: skip
        continues = {"video": os.path.abspath(entry.output), "frame": settings.frames - 1,
                     "frame_file": os.path.abspath(last_frame_path(entry.output))}  # fmt: skip
        if entry.record is not None:
            continues.update(index=entry.record.index, name=entry.record.name)
        offset += settings.frames - 1
        chain.fps, before = settings.fps, entry
    if stopped is None and not made and chain.write_stitched:
        linked.stitch.append(chain)


def _label(entry: PlannedRecord) -> str:
    """How a round is named in the errors of the rounds after it: `prompt 3 (003_a-cat)`."""
    record = entry.record
    return f"prompt {record.index} ({record.stem})" if record is not None else str(entry.output)


def stitch_made_rounds(chain: Chain, crf: int, overwrite: bool) -> Path | None:
    """The stitched video of a chain whose rounds were all made before (a resumed batch): its parts read back from
    their files (the `--continue-from` latents decoded beforehand: `StartVideo.decoded`).

    Returns:
        The stitched MP4, or None where another process wrote it meanwhile.

    Raises:
        InputError / Pan2Error: a part that cannot be read, or the write failed (nothing is left).
    """
    from pan2cli.pipeline.chain_frames import Stitcher, video_chunks

    stitcher = Stitcher(chain.stitched, chain.fps, crf, overwrite=overwrite, skip_if_taken=not overwrite)
    try:
        if chain.source is not None:
            stitcher.add(chain.source.chunks())
        for video in chain.rounds:
            stitcher.add(video_chunks(video, "the round"))
    except BaseException:
        stitcher.abort()
        raise
    return stitcher.commit()


def stitch_left(
    chains: list[Chain],
    decode: Callable[[StartVideo], None],
    *,
    crf: int,
    overwrite: bool,
    done: Callable[[Path], None],
    failed: Callable[[BaseException], None],
) -> None:
    """`stitch_made_rounds` for each chain of a resumed batch left without its stitched video; a latents source is
    decoded first (`decode`); each written video is handed to `done`, each failure to `failed` (the others go on)."""
    for chain in chains:
        try:
            if chain.source is not None and chain.source.latents is not None and chain.source.decoded is None:
                decode(chain.source)
            path = stitch_made_rounds(chain, crf, overwrite)
        except Pan2Error as exc:
            failed(exc)
            continue
        if path is not None:
            done(path)
