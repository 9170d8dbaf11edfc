"""`run_batch`: a generation from request to written videos, with the rules of `pan2 generate` (which runs it, as does
`VideoGenerator.generate_file`), in this process (the only one, or one rank of several).

1. Every input checked before any model loads (`prepare_batch`), on every rank: a bad option or file is the command's
   error (rank 0 says it once); a prompt-file record that cannot run is that record's failure, and the others run.
2. The checkpoint located (`open_generator`: a download, once) and each job checked against it.
3. The videos made (`VideoGenerator.generate_batch`), each handed over as soon as it is written, and a chain's
   stitched video after its last round (`pan2cli.pipeline.chains`; a resumed chain whose rounds all exist gets it
   from their files, before). In a batch (a prompt file) a prompt whose run fails (`PER_JOB_FAILURES`) is reported
   and the others go on (the rounds after it in its chain are not made), an output that appeared meanwhile is
   skipped (`--skip-existing`); one prompt's failure is the command's (raised). Anything else raised (a bug) stops
   the run.
4. A batch's totals over every rank, said once by rank 0.

What the run says goes through a `BatchReport` (the CLI prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pan2cli import distributed
from pan2cli.config import RuntimeConfig
from pan2cli.errors import InputError, Pan2Error
from pan2cli.pipeline.batch_plan import BatchRequest, prepare_batch
from pan2cli.pipeline.chains import stitch_left
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, RoundNotMade


def _nothing(*args) -> None:
    return None


@dataclass(frozen=True)
class BatchReport:
    """What a run says as it goes (each None by default: the Python API's silence; `pan2 generate` prints).

    Attributes:
        warning: a warning, said by rank 0 (a prompt file's unknown field, an option that changes nothing here).
        failed: `(error, origin)`: a record that cannot run (origin None: the error names the file and the record),
            or a prompt whose run failed (origin: its record, "prompts.json: prompt 3 (003_a-cat)").
        skipped: `(output, appeared)`: an output that exists under `skip_existing`, found when planned or, with
            `appeared`, written by another process while this one ran.
        written: a video written (its result: `output`, `seconds`, ...), as soon as it is.
        stitched: a chain's stitched video written (after its last round's `written`).
        summary: a batch's `BatchOutcome` at its end, its totals over every rank, on rank 0.
    """

    warning: Callable[[str], None] = _nothing
    failed: Callable[[BaseException, str | None], None] = _nothing
    skipped: Callable[[Path, bool], None] = _nothing
    written: Callable[[GenerationResult], None] = _nothing
    stitched: Callable[[Path], None] = _nothing
    summary: Callable[["BatchOutcome"], None] = _nothing


@dataclass
class BatchOutcome:
    """What a run made. The lists are this process's; the totals (a batch's, after its end) are every rank's.

    Attributes:
        batch: a prompt file (its failures are its records'), not one prompt (whose failure is raised).
        results: each job's result, in order (made, failed or skipped meanwhile).
        failures: the records that could not run and the prompts whose run failed, each error naming its record.
        skipped: the outputs that existed (`skip_existing`), when planned or while the batch ran.
        written, skipped_total, failed_total: the videos written, skipped and failed over every rank.
    """

    batch: bool
    results: list[GenerationResult] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    written: int = 0
    skipped_total: int = 0
    failed_total: int = 0


def run_batch(
    request: BatchRequest,
    given: RuntimeConfig,
    open_generator: Callable[[], object],
    report: BatchReport = BatchReport(),
) -> BatchOutcome:
    """Make what `request` asks for (module docstring), every rank its share.

    Args:
        request: what to generate.
        given: the run-time options as given (`precision` and `chunk_latent_frames` None: the preset's).
        open_generator: the `VideoGenerator` to run with (`from_pretrained` with `given`), called once the inputs are
            checked and only if any rank has a job left.
        report: what the run says.

    Returns:
        A `BatchOutcome`.

    Raises:
        InputError / Pan2Error: the command's error (a bad option or file, a checkpoint that cannot be located, a
            model that fails to load), or for one prompt its failure.
        Exception: anything else raised by a job's run (a bug): the run stops.
    """
    # 1. Every input and output checked before any model loads (every rank; rank 0 reports a shared failure).
    error = prepared = None
    try:
        prepared = prepare_batch(request, given, world=distributed.world_size(), rank=distributed.rank())
    except Pan2Error as exc:
        error = exc
    distributed.raise_if_any_failed(error)
    plan = prepared.plan
    outcome = BatchOutcome(plan.batch, failures=list(plan.failures), skipped=list(plan.skipped))
    if distributed.is_main():
        for line in prepared.warnings:
            report.warning(line)
    for failure in plan.failures:  # records that cannot run: each rank reports its own, the others go on
        report.failed(failure, None)
    for path in plan.skipped:
        report.skipped(path, False)
    opened: list = []  # the generator, opened once, when needed

    def generator_once():
        if not opened:
            opened.append(open_generator())
        return opened[0]

    def stitch_failed(exc: BaseException) -> None:
        if not plan.batch:  # one prompt's failure is the command's
            raise exc
        outcome.failures.append(exc)
        report.failed(exc, None)

    if (
        plan.batch or distributed.is_main()
    ):  # chains made before but for their stitched video (a latents source
        stitch_left(  # is decoded by the checkpoint's VAE)
            list(plan.stitch), lambda source: generator_once().decode_start_video(source), crf=request.crf,
            overwrite=request.overwrite, done=report.stitched, failed=stitch_failed,
        )  # fmt: skip
    if distributed.sum_all(len(plan.jobs)) == 0:  # nothing left to make on any rank: load nothing
        return _totals(outcome, report)

    # 2. The checkpoint located (a download, once) and the jobs checked against it.
    error, generator, jobs = None, None, []
    try:
        generator = generator_once()
        jobs = [job for job in plan.jobs if _checked(generator, job, outcome, report)]
    except Exception as exc:  # a Pan2Error or the unexpected: the other ranks must not wait either way
        error = exc
    distributed.raise_if_any_failed(error)

    # 3. The videos. One prompt's failure is the command's; a batch's prompt is reported and the batch goes on.
    def on_result(result: GenerationResult) -> None:
        if result.skipped:  # another process wrote it since the batch began
            outcome.skipped.append(result.job.output)
            report.skipped(result.job.output, True)
        elif result.error is None:
            if result.output is not None:  # under a shared job, rank 0 writes
                report.written(result)
            if result.stitched is not None:
                report.stitched(result.stitched)
        else:
            outcome.failures.append(result.error)
            if plan.batch:  # a round not made names itself
                report.failed(
                    result.error, None if isinstance(result.error, RoundNotMade) else result.job.origin
                )

    if jobs:
        outcome.results = generator.generate_batch(
            jobs, preset=prepared.preset, ranks_share_jobs=not plan.batch, on_result=on_result
        )
    if not plan.batch and outcome.failures:
        raise outcome.failures[0]
    return _totals(outcome, report)


def _checked(generator, job: GenerationJob, outcome: BatchOutcome, report: BatchReport) -> bool:
    """Whether `job` passed `check_job`; in a batch a failure is the record's (reported, kept in the outcome), for
    one prompt the command's (raised)."""
    try:
        generator.check_job(job)
    except InputError as exc:
        if not outcome.batch:
            raise
        outcome.failures.append(exc)
        report.failed(exc, None)
        return False
    return True


def _totals(outcome: BatchOutcome, report: BatchReport) -> BatchOutcome:
    """A batch's end: every rank's counts, said by rank 0 once all are done (one prompt: nothing to add)."""
    if not outcome.batch:
        return outcome
    distributed.wait_for_all("generate-done")
    outcome.failed_total = distributed.sum_all(len(outcome.failures))
    outcome.written = distributed.sum_all(sum(r.error is None and not r.skipped for r in outcome.results))
    outcome.skipped_total = distributed.sum_all(len(outcome.skipped))
    if distributed.is_main():
        report.summary(outcome)
    distributed.sum_all(0)  # everyone has said it before anyone exits
    return outcome
