"""Hugging Face hub downloads: one quick reachability check, then one mapping of huggingface_hub's errors to ours, for every component."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pan2cli.errors import DownloadError, InputError

# Whether this process found the hub unreachable and switched huggingface_hub to its cache (None: not checked yet).
_unreachable: bool | None = None
_said_unreachable = False


def _use_the_cache_if_unreachable() -> None:
    """Once per process: one request to the hub (HF_HUB_ETAG_TIMEOUT, 10 s by default); if it fails,
    huggingface_hub goes offline for this process and reads its cache.

    Without it, an unreachable hub costs huggingface_hub's retries (five, up to 8 s apart) for every
    file before it falls back to the cache.
    """
    global _unreachable
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if _unreachable is not None or constants.HF_HUB_OFFLINE:
        return
    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        _unreachable = False
    except Exception:  # no route, refused, DNS, TLS, timeout: whatever it is, downloads would fail too
        # The constant is what the HTTP session of every huggingface_hub version checks; the variable is what
        # some 1.x versions' snapshot_download reads (through is_offline_mode) to take the cache instead.
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
        _unreachable = True


def _say_unreachable_once() -> None:
    global _said_unreachable
    from huggingface_hub import constants

    from pan2cli.distributed.protocol import env_rank

    if _unreachable and not _said_unreachable and env_rank() == 0:
        print(
            f"Warning: the Hugging Face hub ({constants.ENDPOINT}) is unreachable; using the local cache",
            file=sys.stderr,
        )
    _said_unreachable = True


@contextmanager
def hub_errors(repo_id: str, revision: str | None, *, what: str, local_hint: str) -> Iterator[str]:
    """Check once that the hub answers (else use the cache alone), and turn huggingface_hub's download
    errors into `InputError` / `DownloadError` lines.

    Args:
        repo_id, revision: the repository asked for.
        what: what is downloaded, for messages ("the VAE", "the PAN 2 checkpoint").
        local_hint: how to pass a local copy instead, e.g. "pass --vae PATH to a local ...".

    Yields:
        `repo_id@revision` (or the repo id), for the caller's own messages.

    Raises:
        InputError: no such repository or revision (exit 2).
        DownloadError: gated, offline or the hub unreachable with nothing cached, or a network/disk error (exit 1).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
    _use_the_cache_if_unreachable()
    try:
        yield where
    except GatedRepoError as exc:
        raise DownloadError(
            f"{where} is gated and this machine has no access to it",
            hint=f"accept the licence on huggingface.co and log in (`hf auth login`, or set HF_TOKEN), or {local_hint}",
        ) from exc
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise InputError(
            f"no Hugging Face repository {repo_id!r} (or no access to it)", hint=local_hint
        ) from exc
    except RevisionNotFoundError as exc:
        raise InputError(f"{repo_id} has no revision {revision!r}", hint="check --revision") from exc
    except LocalEntryNotFoundError as exc:  # offline, or the hub unreachable, and nothing cached
        if _unreachable:
            why = f"the Hugging Face hub ({constants.ENDPOINT}) is unreachable and no copy is cached"
        elif constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE is set and no copy is cached"
        else:
            why = "no copy is cached (offline, or the hub is unreachable)"
        raise DownloadError(f"could not download {what} from {where}: {why}", hint=local_hint) from exc
    except OSError as exc:  # network and disk errors below huggingface_hub
        raise DownloadError(f"download of {what} from {where} failed: {exc}", hint=local_hint) from exc
    _say_unreachable_once()


# -- calls to the hub, one function each (so that a reachability probe can wrap them) ---------------
def hub_offline() -> bool:
    """Whether huggingface_hub is in offline mode (`HF_HUB_OFFLINE=1`): no request is made, the cache decides."""
    from huggingface_hub import constants

    # The constant is what the reachability probe sets and what every huggingface_hub version's HTTP session
    # honours; `is_offline_mode()` (>= 1.0) does not read it in every version.
    is_offline = getattr(constants, "is_offline_mode", None)
    variable = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE or variable or (is_offline is not None and is_offline()))


def hub_snapshot(repo_id: str, revision: str | None, allow_patterns: list[str]) -> Path:
    """`snapshot_download` of the files matching `allow_patterns` (cache, token, offline mode and progress bars as usual).

    Returns:
        The snapshot folder, named by the commit that `revision` resolved to (it may not exist when
        nothing matched).
    """
    from huggingface_hub import snapshot_download

    with _connection_errors():
        # Offline, say so explicitly: some huggingface_hub 1.x versions otherwise still list the repo's tree.
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=list(allow_patterns),
                local_files_only=hub_offline(),
            )
        )


def hub_file(repo_id: str, filename: str, *, subfolder: str | None, revision: str | None) -> Path:
    """`hf_hub_download` of one file (cache, token and offline mode as usual): its path in the cache.

    Raises:
        huggingface_hub's `EntryNotFoundError` when the repo has no such file (the caller may look elsewhere).
    """
    from huggingface_hub import hf_hub_download

    with _connection_errors():
        return Path(hf_hub_download(repo_id, filename, subfolder=subfolder, revision=revision))


def hub_list_files(repo_id: str, revision: str | None) -> set[str] | None:
    """Every file path of a repo at `revision`, or None when offline or the hub cannot be reached (the cache decides)."""
    if hub_offline():
        return None
    import huggingface_hub

    try:
        return set(huggingface_hub.list_repo_files(repo_id, revision=revision))
    except Exception as exc:
        if isinstance(exc, _unreachable_errors()):
            return None
        raise


def hub_tensor_shapes(repo_id: str, filename: str, revision: str | None) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape, from the header of one safetensors file of a repo (HTTP range requests: no tensor is downloaded)."""
    import huggingface_hub

    with _connection_errors():
        metadata = huggingface_hub.parse_safetensors_file_metadata(repo_id, filename, revision=revision)
    return {name: tuple(info.shape) for name, info in metadata.tensors.items()}


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "no connection" (offline mode, refused, timed out) in the HTTP client huggingface_hub uses."""
    import importlib

    from huggingface_hub import errors as hub_error_types

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    offline = getattr(
        hub_error_types, "OfflineModeIsEnabled", None
    )  # a ConnectionError in some versions only
    if isinstance(offline, type):
        errors.append(offline)
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            loaded = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(loaded, name) for name in names if isinstance(getattr(loaded, name, None), type)]
    return tuple(errors)


@contextmanager
def _connection_errors() -> Iterator[None]:
    """The HTTP client's connection errors (not OSErrors in httpx) as `ConnectionError`, which `hub_errors` maps."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) or not isinstance(exc, _unreachable_errors()):
            raise
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
