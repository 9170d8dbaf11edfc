"""Tests that the wheel ships presets and kernel sources inside the package and that code finds them."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pan2cli.resources import _find_data_dir
from pan2cli.version import __version__
from tests.subprocess_env import python_env

REPO = Path(__file__).resolve().parents[2]

# Prints where pan2cli and its data were found, as JSON, from whatever pan2cli is on PYTHONPATH.
PROBE = """
import json
import pan2cli
from pan2cli.presets import list_presets, load_preset
from pan2cli.resources import kernels_dir, presets_dir
print(json.dumps({
    "package": pan2cli.__file__,
    "version": pan2cli.__version__,
    "presets_dir": str(presets_dir()),
    "kernels_dir": str(kernels_dir()),
    "frames_5s": load_preset("pan2-5s").frames,
    "names": [p.name for p in list_presets()],
}))
"""


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command, failing the test with its output if it fails; return its stdout."""
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def _env(pythonpath: Path) -> dict[str, str]:
    """Environment for a child Python that imports pan2cli from `pythonpath` only: the project root leaves
    PYTHONPATH, the caller's other entries stay behind `pythonpath` (its packages, hatchling included)."""
    return python_env(
        pythonpath,
        with_project=False,
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",  # keep __pycache__ out of the source tree
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )


def _probe(pythonpath: Path, cwd: Path) -> dict:
    return json.loads(_run([sys.executable, "-c", PROBE], cwd=cwd, env=_env(pythonpath)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the repository, offline with the venv's hatchling."""
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(out),
            str(REPO),
        ],
        cwd=out,
        env=_env(out),
    )
    wheels = sorted(out.glob("pan2cli-*.whl"))
    assert len(wheels) == 1, f"expected one pan2cli wheel in {out}, found {wheels}"
    return wheels[0]


def test_wheel_ships_data_inside_the_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "pan2cli/_presets/pan2-10s.toml" in names
        assert "pan2cli/_kernels/README.md" in names
        # Both extensions' sources ship; the prototypes of kernels/experimental/ do not.
        for folder in ("wan22_vae_decode", "fp8_attention"):
            for path in sorted((REPO / "kernels" / folder).iterdir()):
                assert zf.read(f"pan2cli/_kernels/{folder}/{path.name}") == path.read_bytes()
        assert (REPO / "kernels" / "experimental").is_dir()
        assert not [n for n in names if n.startswith("pan2cli/_kernels/experimental")]
        assert "pan2cli/resources.py" in names
        assert "pan2cli/presets.py" in names
        # No top-level `presets`/`kernels` package: PyPI has an unrelated `kernels` package.
        assert not [n for n in names if n.startswith(("presets/", "kernels/"))]
        top_level = {n.split("/", 1)[0] for n in names}
        assert {t for t in top_level if not t.endswith(".dist-info")} == {"pan2cli"}
        # Every shipped preset file arrives unchanged.
        for path in sorted((REPO / "presets").glob("*.toml")):
            assert zf.read(f"pan2cli/_presets/{path.name}") == path.read_bytes()


def test_installed_wheel_finds_its_own_data(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        cwd=tmp_path,
        env=_env(tmp_path / "nothing"),
    )
    elsewhere = tmp_path / "elsewhere"  # a working directory outside the repository
    elsewhere.mkdir()
    found = _probe(target, elsewhere)
    package = (target / "pan2cli").resolve()
    assert Path(found["package"]).resolve().parent == package  # the installed copy, not the repo
    # The wheel's metadata and the installed package carry the version of pan2cli/version.py (hatch reads it).
    assert wheel.name.startswith(f"pan2cli-{__version__}-") and found["version"] == __version__
    assert Path(found["presets_dir"]) == package / "_presets"
    assert Path(found["kernels_dir"]) == package / "_kernels"
    assert found["frames_5s"] == 121
    assert found["names"] == ["pan2-5s", "pan2-10s", "pan2-20s"]


def test_source_tree_uses_repo_dirs(tmp_path: Path) -> None:
    found = _probe(REPO, tmp_path)
    assert Path(found["package"]).resolve().parent == REPO / "pan2cli"
    assert Path(found["presets_dir"]) == REPO / "presets"
    assert Path(found["kernels_dir"]) == REPO / "kernels"
    assert found["frames_5s"] == 121


# ---- the lookup rules, on fake layouts -------------------------------------------------------------


def test_installed_dir_wins_over_source_dir(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "presets").mkdir()
    (tmp_path / "pan2cli" / "_presets").mkdir(parents=True)
    assert _find_data_dir("_presets", "presets", tmp_path / "pan2cli") == tmp_path / "pan2cli" / "_presets"


def test_source_dir_used_without_installed_dir(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "presets").mkdir()
    (tmp_path / "pan2cli").mkdir()
    assert _find_data_dir("_presets", "presets", tmp_path / "pan2cli") == tmp_path / "presets"


def test_broken_install_does_not_borrow_a_site_packages_dir(tmp_path: Path) -> None:
    # site-packages may hold an unrelated `kernels` package next to a pan2cli that lacks `_kernels`.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "pan2cli").mkdir()
    with pytest.raises(RuntimeError, match="incomplete") as info:
        _find_data_dir("_kernels", "kernels", tmp_path / "pan2cli")
    assert str(tmp_path / "pan2cli" / "_kernels") in str(info.value)
    assert str(tmp_path / "kernels") in str(info.value)


def test_missing_everywhere_raises(tmp_path: Path) -> None:
    (tmp_path / "pan2cli").mkdir()
    with pytest.raises(RuntimeError, match="'presets' not found"):
        _find_data_dir("_presets", "presets", tmp_path / "pan2cli")


def test_readme_set_up_says_how_to_get_torch_without_a_gpu():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section
    # .ci/run runs exactly these two lines, verbatim.
    setup = section.split("<!-- setup:begin", 1)[1].split("<!-- setup:end", 1)[0]
    commands = [line for line in setup.splitlines()[1:] if line and not line.startswith("```")]
    assert commands == ['pip install -e ".[test]"', "python -m pytest"]
