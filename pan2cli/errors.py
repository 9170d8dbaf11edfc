"""Typed errors that the CLI maps to one `Error: ...` line and an exit code.

Library code raises these with a message that names the file or flag and says what to do;
`pan2cli.cli` turns them into stderr lines (see `EXIT_CODES`).
"""

from __future__ import annotations


class Pan2Error(Exception):
    """Base of every known failure. `hint` is an optional second line telling what to try."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


class InputError(Pan2Error):
    """Bad input from the user: a file, a flag value, a shape. Exit code 2."""

    exit_code = 2


class CheckpointError(InputError):
    """A checkpoint that cannot be read or is not the model we expect. Exit code 2."""


class DownloadError(Pan2Error):
    """A Hugging Face download failed, or the hub is unreachable with no cached copy. Exit code 1."""


class KernelBuildError(Pan2Error):
    """The compiled decode kernel could not be built or loaded. Exit code 1."""


class OutOfMemoryError(Pan2Error):
    """The GPU ran out of memory. Exit code 1."""


def out_of_memory(error: BaseException, when: str | None = None, hint: str | None = None) -> OutOfMemoryError:
    """pan2's `OutOfMemoryError` for torch's `torch.OutOfMemoryError` (raise it `from error`); torch-free.

    Args:
        error: torch's exception; its first line is kept ("CUDA out of memory. Tried to allocate ...").
        when: what ran out, e.g. "while loading the VAE decoder": the message is then
            `the GPU ran out of memory <when>: <first line>`; None: the first line alone.
        hint: the line telling what to try.
    """
    text = str(error)
    first_line = text.splitlines()[0] if text else "out of memory"
    return OutOfMemoryError(
        f"the GPU ran out of memory {when}: {first_line}" if when else first_line, hint=hint
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job scheduler, torchrun stopping its workers): unwind as on Ctrl-C.

    A KeyboardInterrupt, so that writers abort and remove their temporary files on the way out.
    """


EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM, as shells report `kill`
