"""Find the data directories (presets, kernel sources) shipped with pan2cli, installed or from source."""

from __future__ import annotations

from pathlib import Path

# The directory of the `pan2cli` package itself: `<site-packages>/pan2cli` in an installed wheel,
# `<repo>/pan2cli` in a source checkout or an editable install.
_PACKAGE_DIR = Path(__file__).resolve().parent


def _find_data_dir(installed_name: str, source_name: str, package_dir: Path | None = None) -> Path:
    """Locate one shipped data directory.

    The wheel force-includes the top-level `<source_name>/` folder as `pan2cli/<installed_name>`
    (see pyproject.toml), so an installed package has it inside the package; a source tree has it
    next to the package instead.

    Args:
        installed_name: Name of the directory inside the installed package, e.g. `_presets`.
        source_name: Name of the directory at the top of the source tree, e.g. `presets`.
        package_dir: Directory of the `pan2cli` package; defaults to this module's directory.

    Returns:
        The absolute path of the directory.

    Raises:
        RuntimeError: Neither location exists, i.e. pan2cli is installed incompletely.
    """
    package_dir = _PACKAGE_DIR if package_dir is None else package_dir
    installed = package_dir / installed_name
    if installed.is_dir():
        return installed
    # Only trust the parent directory if it is our source tree: in a broken installed copy the
    # parent is site-packages, where `kernels/` may well be the unrelated PyPI package `kernels`.
    source_root = package_dir.parent
    source = source_root / source_name
    if source.is_dir() and (source_root / "pyproject.toml").is_file():
        return source
    raise RuntimeError(
        f"pan2cli data directory {source_name!r} not found: looked for {installed} (installed "
        f"package) and {source} (source tree). The pan2cli installation is incomplete; "
        f"reinstall it (pip install --force-reinstall pan2cli)."
    )


def presets_dir() -> Path:
    """Return the directory of the shipped preset `.toml` files.

    Returns:
        `<package>/_presets` in an installed wheel, else `<repo>/presets` in a source tree.

    Raises:
        RuntimeError: Neither directory exists (a broken install).
    """
    return _find_data_dir("_presets", "presets")


def kernels_dir() -> Path:
    """Return the directory of the shipped C++/CUDA kernel sources.

    Returns:
        `<package>/_kernels` in an installed wheel, else `<repo>/kernels` in a source tree.

    Raises:
        RuntimeError: Neither directory exists (a broken install).
    """
    return _find_data_dir("_kernels", "kernels")
