"""The extension's Python face without a GPU: op registration and the build log."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pan2cli import kernel_build
from pan2cli.vae.kernel import build, choice, ops, status
from pan2cli.vae.kernel.ops import register_ops


@pytest.fixture(autouse=True)
def _real_extension_restored(monkeypatch):
    """The stand-in modules registered here must not outlive the test: on a GPU host the real extension may
    already be loaded in this process (`build._loaded`), and its ops call whichever module was registered last."""
    monkeypatch.setattr(ops, "_extension", list(ops._extension))


def _recording_extension(calls: list) -> SimpleNamespace:
    def record(name):
        def op(*args):
            calls.append((name, args))
            if name == "head_to_uint8":
                args[-1].fill_(7)  # the op's output, so the test sees the mutation come back

        return op

    return SimpleNamespace(
        **{name: record(name) for name in ("rms_norm_silu", "phase_interleave", "head_to_uint8")}
    )


def test_ops_are_torch_ops_that_call_the_extension():
    calls: list = []
    ops = register_ops(_recording_extension(calls))
    assert ops.head_to_uint8 is torch.ops.pan2.head_to_uint8
    partials, bias, out = (
        torch.zeros(1, 2, 2, 36),
        torch.zeros(12),
        torch.zeros(1, 4, 4, 3, dtype=torch.uint8),
    )
    ops.head_to_uint8(partials, None, partials, bias, out)
    name, args = calls[-1]
    assert name == "head_to_uint8" and args[0] is partials and args[1] is None and args[2] is partials
    assert int(out.min()) == 7
    x = torch.zeros(1, 3, 2, 2, 8, dtype=torch.bfloat16)
    ops.rms_norm_silu(x, torch.ones(8), None, None, None, torch.empty_like(x), True, None, True)
    name, args = calls[-1]
    assert name == "rms_norm_silu" and args[7] is None and args[8] is True


def test_fakes_let_torch_trace_the_ops_without_running_them():
    calls: list = []
    ops = register_ops(_recording_extension(calls))
    with FakeTensorMode():
        x = torch.empty(1, 3, 2, 2, 8, dtype=torch.bfloat16)
        ops.rms_norm_silu(x, torch.ones(8), None, None, None, torch.empty_like(x), True, None, False)
        phases = torch.empty(2, 3, 3, 32, dtype=torch.bfloat16)
        ops.phase_interleave(
            phases, torch.zeros(8), None, torch.empty(1, 2, 4, 4, 8, dtype=torch.bfloat16), 1, 0
        )
    assert calls == []


def test_calling_the_ops_imports_no_compiler_stack():
    """A `torch.library.custom_op` imports torch._dynamo and sympy (about 3 s) at its first call,
    inside the decode; the ops are registered so that calling them imports nothing."""
    script = """
import sys, torch
from types import SimpleNamespace
from pan2cli.vae.kernel.ops import register_ops
ops = register_ops(SimpleNamespace(head_to_uint8=lambda current, previous, before, bias, out: out.fill_(3)))
before = set(sys.modules)
out = torch.zeros(1, 4, 4, 3, dtype=torch.uint8)
ops.head_to_uint8(torch.zeros(1, 2, 2, 36), None, None, torch.zeros(12), out)
assert int(out.min()) == 3
print(sorted(set(sys.modules) - before))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_build_log_keeps_the_whole_output_also_when_it_is_echoed(tmp_path, capfd):
    for echo in (False, True):
        log = tmp_path / f"build-{echo}.log"
        with kernel_build._output_to(log, echo=echo):
            # ninja and nvcc are child processes writing to fds 1 and 2
            command = "import sys; print('from a compiler'); print('err', file=sys.stderr)"
            subprocess.run([sys.executable, "-c", command], check=True)
        text = log.read_text()
        assert "from a compiler" in text and "err" in text
        shown = capfd.readouterr()
        assert ("from a compiler" in shown.err) == echo
    print("after")  # fds 1 and 2 are restored: this reaches pytest again
    assert "after" in capfd.readouterr().out


def test_status_names_the_conv_engines(monkeypatch, tmp_path):
    """On a kernel target, `pan2 kernels status` names the engine of each group of convolutions: the
    CUTLASS conv where the build has it (sm_90a: our persistent kernel; sm_100a: CUTLASS's), else the
    fixed-order Triton kernel at low resolution, else cuDNN with the rounding caveat."""
    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(status, "current_arch", lambda device=None: "sm_90a")
    for module in (build, status):
        monkeypatch.setattr(module, "triton_available", lambda: True)
    monkeypatch.setattr(build, "cutlass_include_dirs", lambda: [tmp_path])
    convs = status.kernel_status().convs
    assert "persistent warp-specialised CUTLASS conv" in convs and "every resolution" in convs
    assert "Triton kernel for conv_in and post_quant_conv" in convs and "for conv_out" in convs
    assert "cuDNN" not in convs  # no layer left in cuDNN
    monkeypatch.setattr(status, "current_arch", lambda device=None: "sm_100a")
    assert "CUTLASS's implicit-GEMM conv (tcgen05" in status.kernel_status().convs
    monkeypatch.setattr(status, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(build, "cutlass_include_dirs", lambda: [])
    convs = status.kernel_status().convs
    assert "fixed-order Triton kernel below" in convs and "no CUTLASS conv" in convs
    for module in (build, status):
        monkeypatch.setattr(module, "triton_available", lambda: False)
    report = status.kernel_status()
    assert "Triton is not installed" in report.convs and "sm_90a" in report.decode_path


def test_first_use_note_until_the_kernel_is_built_and_its_convs_compiled(monkeypatch, tmp_path):
    """`pan2 decode` says once that a first use builds and compiles (a wait of minutes, not a hang): before the extension is
    built, then while only the convolutions are missing, and no more once a full-size decode (or
    `pan2 kernels build`) marked them compiled into the Triton cache in use."""
    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path / "cache"))
    for module in (choice, status):
        monkeypatch.setattr(module, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(choice, "why_not_applicable", lambda device, dtype: None)
    for module in (build, status):
        monkeypatch.setattr(module, "triton_available", lambda: True)
    monkeypatch.setattr(build, "_triton_cache_dir", lambda: str(tmp_path / "triton"))
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    assert "builds the decode kernel and compiles its Triton convolutions" in choice.first_use_note(
        gpu, bf16, "auto"
    )
    assert choice.first_use_note(gpu, bf16, "off") is None
    library = build.kernel_spec("sm_90a").library
    library.parent.mkdir(parents=True)
    library.touch()
    note = choice.first_use_note(gpu, bf16, "auto")
    assert note.startswith("First use on this machine: the decode compiles its Triton convolutions")
    assert "`pan2 kernels build`" in note
    build.mark_convs_compiled("sm_90a")
    assert choice.first_use_note(gpu, bf16, "auto") is None and status.kernel_status().convs_compiled
    monkeypatch.setattr(build, "_triton_cache_dir", lambda: str(tmp_path / "another-triton-cache"))
    assert choice.first_use_note(gpu, bf16, "auto") is not None  # compiled into a cache no longer in use
    build.mark_convs_compiled("sm_90a")  # compiling into the other cache does not forget the first
    monkeypatch.setattr(build, "_triton_cache_dir", lambda: str(tmp_path / "triton"))
    assert choice.first_use_note(gpu, bf16, "auto") is None


# A failed build as ninja and nvcc write it to build.log (warnings first), then the exception's text.
_NVCC_LOG = """\
[1/3] c++ -MMD -MF decode.o.d -DTORCH_EXTENSION_NAME=wan22_vae_decode -O3 -std=c++17 -c decode.cpp -o decode.o
[2/3] /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math -c head.cu -o head.cuda.o
FAILED: head.cuda.o
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math -c head.cu -o head.cuda.o
head.cu(12): warning #177-D: variable "error_count" was declared but never referenced
head.cu(15): warning #550-D: variable "lane" was set but never used
head.cu(42): error: identifier "blockDimX" is undefined
head.cu(57): error: expected a ";"
2 errors detected in the compilation of "head.cu".
ninja: build stopped: subcommand failed.
"""


def test_build_error_names_the_compilers_first_error():
    """A failed build's one-line reason is the first compiler error (warnings and torch's
    'Error building extension' wrapper are not errors of the source)."""
    exception = "Error building extension 'wan22_vae_decode'"
    assert (
        kernel_build._first_compiler_error(_NVCC_LOG + "\n" + exception)
        == 'head.cu(42): error: identifier "blockDimX" is undefined'
    )
    # torch's wrapper line is skipped also where it comes first (a log appended to by an earlier build)
    assert kernel_build._first_compiler_error(
        f"{exception}\n  ptxas ERROR : Entry function uses too much shared data  \n"
    ) == ("ptxas ERROR : Entry function uses too much shared data")


def test_build_error_without_an_error_line_is_the_last_line():
    killed = "[1/3] /usr/local/cuda/bin/nvcc -c head.cu -o head.cuda.o\nKilled\nninja: build stopped: subcommand failed.\n\n"
    assert kernel_build._first_compiler_error(killed) == "ninja: build stopped: subcommand failed."
    assert kernel_build._first_compiler_error("") == "the build failed without output"
    assert kernel_build._first_compiler_error("\n  \n") == "the build failed without output"
