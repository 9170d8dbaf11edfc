"""The extension's Python face without a GPU: custom-op registration and the build log."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pan2cli.vae import kernel


def _recording_extension(calls: list) -> SimpleNamespace:
    def record(name):
        def op(*args):
            calls.append((name, args))
            if name == "head_to_uint8":
                args[-1].fill_(7)  # the op's output, so the test sees the mutation come back

        return op

    return SimpleNamespace(**{name: record(name) for name in ("rms_norm_silu", "phase_interleave", "head_to_uint8")})


def test_ops_are_torch_custom_ops_that_call_the_extension():
    calls: list = []
    ops = kernel._register_ops(_recording_extension(calls))
    assert ops.head_to_uint8 is torch.ops.pan2.head_to_uint8
    y, bias, out = (
        torch.zeros(1, 2, 2, 12, dtype=torch.bfloat16),
        torch.zeros(12),
        torch.zeros(1, 4, 4, 3, dtype=torch.uint8),
    )
    ops.head_to_uint8(y, bias, out)
    assert calls[-1][0] == "head_to_uint8" and calls[-1][1][0] is y
    assert int(out.min()) == 7
    x = torch.zeros(1, 3, 2, 2, 8, dtype=torch.bfloat16)
    ops.rms_norm_silu(x, torch.ones(8), None, None, None, torch.empty_like(x), True, None, True)
    name, args = calls[-1]
    assert name == "rms_norm_silu" and args[7] is None and args[8] is True


def test_fakes_let_torch_trace_the_ops_without_running_them():
    calls: list = []
    ops = kernel._register_ops(_recording_extension(calls))
    with FakeTensorMode():
        x = torch.empty(1, 3, 2, 2, 8, dtype=torch.bfloat16)
        ops.rms_norm_silu(x, torch.ones(8), None, None, None, torch.empty_like(x), True, None, False)
        phases = torch.empty(2, 3, 3, 32, dtype=torch.bfloat16)
        ops.phase_interleave(phases, torch.zeros(8), None, torch.empty(1, 2, 4, 4, 8, dtype=torch.bfloat16), 1, 0)
    assert calls == []


def test_build_log_keeps_the_whole_output_also_when_it_is_echoed(tmp_path, capfd):
    for echo in (False, True):
        log = tmp_path / f"build-{echo}.log"
        with kernel._output_to(log, echo=echo):
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
    """On a kernel target, `pan2 kernels status` says whether the low-resolution convs run in the
    fixed-order Triton kernel or, without Triton, in cuDNN with the rounding caveat."""
    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(kernel, "triton_available", lambda: True)
    assert "fixed-order Triton" in kernel.kernel_status().convs
    monkeypatch.setattr(kernel, "triton_available", lambda: False)
    status = kernel.kernel_status()
    assert "Triton is not installed" in status.convs and "sm_90a" in status.decode_path
