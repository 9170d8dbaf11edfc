"""Write a file under a temporary name in its folder, then rename it: no half-written file is ever left, and a write
that fails is one error naming the file and why (`could not write x.json: no space left on device`).

torch is imported only by `save_torch`: the CLI imports this module before it needs torch.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

from pan2cli.errors import Pan2Error


def write_failure(path: Path, error: OSError) -> Pan2Error:
    """pan2's error for an OSError while writing `path`: the file and the system's reason, lower-cased
    (`could not write out/x.pt: no space left on device`)."""
    reason = error.strerror or str(error) or type(error).__name__
    return Pan2Error(f"could not write {path}: {reason[:1].lower()}{reason[1:]}")


def replace_into(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` for a temporary path beside `path`, then `os.replace` it into place.

    Raises:
        Pan2Error: the write or the rename failed with an OSError (a full disk, no permission): `write_failure`;
            the temporary file is removed and `path` is left as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise write_failure(path, exc) from exc
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` as UTF-8 (not atomic by itself: call it inside `replace_into`)."""
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


class _RecordingWriter:
    """A file object for `torch.save` that writes all it is given and keeps the first OSError.

    torch's zip writer turns a failed write into `RuntimeError: ... unexpected pos 704 vs 598`, which says neither
    the file nor the cause; the OSError it swallowed (`[Errno 28] No space left on device`) is kept here. A short
    write (the disk filling up mid-call) is continued, so that the next call raises the system's error."""

    def __init__(self, raw):
        self._raw = raw
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                written = self._raw.write(view[done:])
                if not written:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += written
        except OSError as exc:
            self.error = self.error or exc
            raise
        return done

    def flush(self) -> None:
        self._raw.flush()


def _short_write(path: Path) -> OSError:
    """The cause of a torch.save that came out short without a failed write seen: a full disk when its folder has no
    space left, else an I/O error."""
    try:
        stats = os.statvfs(path.parent)
        full = stats.f_bavail * stats.f_frsize == 0
    except (OSError, AttributeError):  # statvfs: POSIX only
        full = False
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, os.strerror(code))


def save_torch(obj: Any, path: Path) -> None:
    """`torch.save(obj, path)`, with the OSError behind a failed write raised as itself (not as torch's "unexpected
    pos" RuntimeError). Not atomic by itself: call it inside `replace_into`.

    Raises:
        OSError: a write failed (a full disk, a quota).
    """
    import torch

    with open(path, "wb", buffering=0) as raw:
        sink = _RecordingWriter(raw)
        try:
            torch.save(obj, sink)
        except RuntimeError as exc:
            if sink.error is not None:
                raise sink.error from None
            if "unexpected pos" in str(exc):  # the file is shorter than what torch handed over
                raise _short_write(Path(path)) from exc
            raise
