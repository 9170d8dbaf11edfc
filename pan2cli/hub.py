"""Hugging Face hub downloads: one quick reachability check, then one mapping of huggingface_hub's errors to ours, for every component."""

from __future__ import annotations

import sys
from contextlib import contextmanager
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
        constants.HF_HUB_OFFLINE = True  # read on every request (huggingface_hub's is_offline_mode)
        _unreachable = True


def _say_unreachable_once() -> None:
    global _said_unreachable
    from huggingface_hub import constants

    from pan2cli import distributed

    if _unreachable and not _said_unreachable and distributed.env_rank() == 0:
        print(f"Warning: the Hugging Face hub ({constants.ENDPOINT}) is unreachable; using the local cache", file=sys.stderr)
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
        raise InputError(f"no Hugging Face repository {repo_id!r} (or no access to it)", hint=local_hint) from exc
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


def looks_like_path(spec: str) -> bool:
    """Whether a `--model`-style spec that does not exist locally is a (missing) path rather than a repo id `owner/name`."""
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.count("/") != 1
