"""Hugging Face hub downloads: one mapping of huggingface_hub's errors to ours, for every component."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from pan2cli.errors import DownloadError, InputError


@contextmanager
def hub_errors(repo_id: str, revision: str | None, *, what: str, local_hint: str) -> Iterator[str]:
    """Turn huggingface_hub's download errors into `InputError` / `DownloadError` lines.

    Args:
        repo_id, revision: the repository asked for.
        what: what is downloaded, for messages ("the VAE", "the PAN 2 checkpoint").
        local_hint: how to pass a local copy instead, e.g. "pass --vae PATH to a local ...".

    Yields:
        `repo_id@revision` (or the repo id), for the caller's own messages.

    Raises:
        InputError: no such repository or revision (exit 2).
        DownloadError: gated, offline with nothing cached, or a network/disk error (exit 1).
    """
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
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
        raise DownloadError(
            f"could not download {what} from {where} and no copy is cached (offline, or the hub is unreachable)",
            hint=local_hint,
        ) from exc
    except OSError as exc:  # network and disk errors below huggingface_hub
        raise DownloadError(f"download of {what} from {where} failed: {exc}", hint=local_hint) from exc


def looks_like_path(spec: str) -> bool:
    """Whether a `--model`-style spec that does not exist locally is a (missing) path rather than a repo id `owner/name`."""
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.count("/") != 1
