"""`pan2 --help/--version`, `pan2 presets`, `pan2 doctor`."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pan2cli
from pan2cli.cli import cli
from pan2cli.presets import load_preset
from tests.subprocess_env import python_env


def _commands(command=cli, path=("pan2",)):
    """(path, command) for the group and every command and group under it, read from the click group itself."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_version(run_cli):
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"pan2 {pan2cli.__version__}"


COMMANDS = ["decode", "doctor", "generate", "kernels", "presets"]


def test_help_lists_commands_and_exit_codes(run_cli):
    """Every command is registered on the group and listed in its `Commands:` section (the names
    also appear in the group's example text, so finding them anywhere in the help proves nothing)."""
    assert sorted(cli.commands) == COMMANDS
    result = run_cli("--help")
    assert result.exit_code == 0
    listed = result.stdout.split("\nCommands:\n", 1)[1].split("\n\n", 1)[0]
    assert re.findall(r"^  (\S+)", listed, re.M) == COMMANDS
    assert "Exit codes" in result.stdout and "130" in result.stdout


def test_every_decode_option_is_documented_with_examples(run_cli):
    text = run_cli("decode", "--help").stdout
    options = [
        opt
        for param in cli.commands["decode"].params
        for opt in getattr(param, "opts", [])
        if opt.startswith("--")
    ]
    assert len(options) >= 12
    for option in options:
        assert re.search(rf"{option}\b", text), option
    assert "Examples:" in text and "pan2 decode latents.pt -o video.mp4" in text


def test_every_command_has_examples_of_its_own(run_cli):
    for path, _ in _commands():
        result = run_cli(*path[1:], "--help")
        assert result.exit_code == 0, path
        assert "Examples:" in result.stdout, path
        examples = result.stdout.split("Examples:", 1)[1]
        assert re.search(rf"^ +{re.escape(' '.join(path))}( |$)", examples, re.M), path


# `pan2 --help`, `--version` and every command's --help, in a fresh interpreter: they must not import torch.
_HELP_WITHOUT_TORCH = """
import sys
from pan2cli.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print("exit", exc.code, "torch" in sys.modules, file=sys.stderr)
"""


def test_help_and_version_do_not_import_torch():
    env = python_env()
    for args in [["--version"], *([*path[1:], "--help"] for path, _ in _commands())]:
        proc = subprocess.run(
            [sys.executable, "-c", _HELP_WITHOUT_TORCH, *args], capture_output=True, text=True, env=env
        )
        assert proc.stderr.splitlines()[-1] == "exit 0 False", (args, proc.stderr)
        assert proc.stdout.startswith("pan2 " if args == ["--version"] else "Usage: pan2"), args


def _without_pan2_debug(monkeypatch) -> None:
    """PAN2_DEBUG unset now and after the test, also if `--debug` sets it in this process (a plain `delenv`
    of an unset variable records nothing to restore: setenv first records its absence)."""
    monkeypatch.setenv("PAN2_DEBUG", "")
    monkeypatch.delenv("PAN2_DEBUG")


def _corrupt_latents(tmp_path: Path) -> Path:
    path = tmp_path / "bad.pt"
    path.write_text("not a tensor\n")
    return path


def test_a_known_error_is_one_line_without_a_traceback(run_cli, tiny_vae, tmp_path, monkeypatch):
    _without_pan2_debug(monkeypatch)
    result = run_cli("decode", _corrupt_latents(tmp_path), "--vae", tiny_vae, "--device", "cpu")
    assert result.exit_code == 2
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("Error:")] == [
        f"Error: latents file {tmp_path / 'bad.pt'} could not be read (truncated or not a latents file)"
    ]


@pytest.mark.parametrize("how", ["--debug", "PAN2_DEBUG=1"])
def test_debug_shows_the_traceback_of_a_known_error(run_cli, tiny_vae, tmp_path, monkeypatch, how):
    """`pan2 --debug ...` and `PAN2_DEBUG=1` print the traceback of a known error (exit code and
    `Error:` line unchanged); `PAN2_DEBUG=0` does not."""
    _without_pan2_debug(monkeypatch)  # --debug sets PAN2_DEBUG in this process
    args = ["decode", _corrupt_latents(tmp_path), "--vae", tiny_vae, "--device", "cpu"]
    if how == "--debug":
        result = run_cli("--debug", *args)
    else:
        monkeypatch.setenv("PAN2_DEBUG", "1")
        result = run_cli(*args)
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr, result.stderr
    assert "pan2cli.errors.InputError: latents file" in result.stderr  # the error's own traceback
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error:")]) == 1
    monkeypatch.setenv("PAN2_DEBUG", "0")
    assert "Traceback" not in run_cli(*args).stderr


def test_unknown_option_is_a_usage_error(run_cli):
    result = run_cli("decode", "x.pt", "--no-such-flag")
    assert result.exit_code == 2


def test_presets_list_and_show(run_cli):
    """`pan2 presets` is registered and works: `list` names the shipped presets, `show` prints one."""
    listing = run_cli("presets", "list")
    assert listing.exit_code == 0
    names = [line.split()[0] for line in listing.stdout.splitlines()]
    assert names == ["pan2-5s", "pan2-10s", "pan2-20s"]
    assert listing.stdout.split()[3] == "704x1248"  # HxW, as --size takes it
    shown = run_cli("presets", "show", "pan2-5s", "--json")
    assert shown.exit_code == 0
    values = json.loads(shown.stdout)
    assert values["frames"] == 121 and values["latent_shape"] == [1, 48, 31, 44, 78]
    assert "frames = 241" in run_cli("presets", "show", "pan2-10s").stdout


def test_presets_show_prints_a_preset_that_loads_back(run_cli, tmp_path):
    shown = run_cli("presets", "show", "pan2-5s")
    assert shown.exit_code == 0
    assert "latent shape [1, 48, 31, 44, 78]" in shown.stdout  # derived values stay, as comments
    (tmp_path / "my.toml").write_text(shown.stdout)
    again = run_cli("presets", "show", tmp_path / "my.toml")
    assert again.exit_code == 0, again.stderr
    mine, shipped = load_preset(tmp_path / "my.toml"), load_preset("pan2-5s")
    assert dataclasses.replace(mine, name=shipped.name, source=shipped.source) == shipped


def test_unknown_preset_exits_2(run_cli):
    result = run_cli("presets", "show", "pan2-99s")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ")
    assert "pan2-10s" in result.stderr  # lists what exists


def _pan2_without_a_gpu(*args, env=None) -> subprocess.CompletedProcess:
    """`python -m pan2cli ARGS` with every GPU hidden (CUDA_VISIBLE_DEVICES=""): the no-GPU behaviour on any host."""
    environment = python_env(CUDA_VISIBLE_DEVICES="", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "pan2cli", *map(str, args)], capture_output=True, text=True, env=environment
    )


def test_doctor_reports_the_machine(run_cli):
    """`pan2 doctor` is registered and works: `--json` is the machine's report."""
    result = run_cli("doctor", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["pan2cli"] == pan2cli.__version__
    assert report["cuda_available"] == torch.cuda.is_available()
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["ffmpeg"] and "not found" not in report["ffmpeg"]


def test_doctor_without_a_gpu_names_the_reference_decoder():
    proc = _pan2_without_a_gpu("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["gpus"] == [] and report["cuda_available"] is False
    assert "reference" in report["decode_path"] and report["decode_default"] == "cpu, float32"


def test_decode_kernel_require_without_a_gpu_is_refused(run_cli, tiny_vae, latents_file, tmp_path):
    result = run_cli(
        "decode",
        latents_file((48, 1, 2, 2)),
        "--vae",
        tiny_vae,
        "--device",
        "cpu",
        "--decode-kernel",
        "require",
    )
    assert result.exit_code == 2
    assert "Error: --decode-kernel require: the decode runs on cpu" in result.stderr
    assert not (tmp_path / "latents.mp4").exists()


def test_decode_kernel_auto_on_cpu_says_nothing_about_the_kernel(run_cli, tiny_vae, latents_file):
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tiny_vae, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert "Using the reference decoder" not in result.stderr  # on the CPU it is the only path
    assert "(reference decoder, " in result.stderr


def test_kernels_status_and_clean(tmp_path):
    env = {"PAN2_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "cache" / "kernels" / "0.0" / "x").mkdir(parents=True)
    status = _pan2_without_a_gpu("kernels", "status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["built"] is False and "reference" in report["decode_path"]
    assert report["fp8_attention"] == {
        "built": False, "build_dir": None, "status": "not built for this machine: it needs an sm_90 GPU, this run is on the cpu",
    }  # fmt: skip
    cleaned = _pan2_without_a_gpu("kernels", "clean", env=env)
    assert cleaned.returncode == 0 and cleaned.stdout.strip() == str(tmp_path / "cache" / "kernels")
    assert not (tmp_path / "cache" / "kernels").exists()


def test_kernels_clean_of_a_cache_that_is_a_file_or_missing(run_cli, tmp_path, monkeypatch):
    """`PAN2_CACHE_DIR=/etc/passwd pan2 kernels clean` printed `/etc/passwd/kernels` with exit 0, and a cache that
    does not exist was printed as the folder emptied."""
    not_a_folder = tmp_path / "passwd"
    not_a_folder.write_text("root:x:0:0\n")
    monkeypatch.setenv("PAN2_CACHE_DIR", str(not_a_folder))
    result = run_cli("kernels", "clean")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines()[0] == (
        f"Error: the kernel cache {not_a_folder / 'kernels'} cannot be there: {not_a_folder} is a file, not a folder"
    )
    assert not_a_folder.read_text() == "root:x:0:0\n"
    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path / "none"))
    result = run_cli("kernels", "clean")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip() == f"Nothing to clean: {tmp_path / 'none' / 'kernels'} does not exist."


def test_kernels_status_without_a_gpu_says_so_plainly(run_cli, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU host
    result = run_cli("kernels", "status")
    assert result.exit_code == 0
    assert "None" not in result.stdout
    assert "no CUDA GPU" in result.stdout and "reference PyTorch decoder" in result.stdout
    assert re.search(r"^convs +PyTorch's CPU convolutions", result.stdout, re.M)


def test_kernels_build_without_a_gpu_exits_1():
    result = _pan2_without_a_gpu("kernels", "build")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: ") and "GPU" in result.stderr


def test_progress_bar_shows_the_rate_and_the_first_item(monkeypatch):
    """The decode's bar shows frames per second and when the first frame was written."""
    import io

    from rich.console import Console

    from pan2cli.cli import _output

    screen = io.StringIO()
    monkeypatch.setattr(
        _output, "stderr", Console(file=screen, force_terminal=True, color_system=None, width=200)
    )
    monkeypatch.setattr(_output.sys.stderr, "isatty", lambda: True)
    with _output.progress_bar("Decoding x.pt", total=9, unit="frames", first="first frame") as advance:
        advance(1)
        advance(8)
    shown = screen.getvalue()
    assert re.search(r"9/9 frames \d+\.\d frames/s first frame after \d+\.\d\d s", shown), shown


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("description", ["Decoding big.pt", "Decoding latents_of_a_long_run_name_0042.pt"])
def test_progress_bar_fits_the_terminal_with_its_totals_and_times(monkeypatch, width, description):
    """On an 80-column terminal the bar once hid its totals and times (`81/… 0:…`). Every number stays whole
    at 80 columns (the description gives way, then the bar; the first frame's time waits for 100 columns, the
    summary line says it), and a wide terminal shows everything."""
    import io

    from rich.console import Console

    from pan2cli.cli import _output

    screen = io.StringIO()
    monkeypatch.setattr(
        _output, "stderr", Console(file=screen, force_terminal=True, color_system=None, width=width)
    )
    monkeypatch.setattr(_output.sys.stderr, "isatty", lambda: True)
    with _output.progress_bar(description, total=81, unit="frames", first="first frame") as advance:
        advance(40)
        advance(41)
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in screen.getvalue().split("\r")]
    last = [line.rstrip("\n") for line in frames if "81/81" in line][-1]
    assert len(last) <= width, last
    assert re.search(
        r" 81/81 frames \d+\.\d frames/s (first frame after \d+\.\d\d s )?0:00:\d\d 0:00:00$", last
    ), last
    assert ("first frame after" in last) == (width >= 100), last
    assert last.startswith(description if width >= 100 else description[:8]), last
