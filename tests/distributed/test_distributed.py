"""Row-split decode across processes (gloo on CPU): exact against one process, and the pieces it is built from."""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pan2cli import distributed
from pan2cli.config import RuntimeConfig
from pan2cli.distributed import launcher, protocol
from pan2cli.errors import InputError
from pan2cli.testing.random_weights import random_vae_state_dict
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.model import WanVAEDecoder
from pan2cli.vae.parallel import RowSplit, row_split_for, split_rows

SMALL = WanVAEConfig(base_dim=16, decoder_base_dim=16)


def _decoder() -> WanVAEDecoder:
    """The reduced-width decoder in float64 with random weights (γ and biases perturbed), the same in every process."""
    decoder = WanVAEDecoder(SMALL).double()
    decoder.load_state_dict(
        random_vae_state_dict(SMALL, seed=3, dtype=torch.float64, encoder=False), strict=True
    )
    return decoder.eval()


def _latents(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _split_decode(rank: int, world: int, init_file: str, shape, chunk: int, out_prefix: str) -> None:
    """One rank: decode its rows, all-gather them, save what it holds (every rank must hold the whole video)."""
    torch.set_num_threads(1)  # the ranks share the CI machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        decoder = _decoder()
        rows = row_split_for(shape[-2])
        assert rows is not None and rows.sizes == split_rows(shape[-2], world)
        chunks = [
            rows.gather_rows(video, dim=3)
            for video in decoder.decode_chunks(_latents(shape), chunk, rows=rows)
        ]
        torch.save(torch.cat(chunks, dim=2), f"{out_prefix}{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, shape, chunk",
    [
        (2, (1, 48, 3, 3, 5), 2),  # rows 2/1
        (3, (1, 48, 3, 7, 3), 4),  # rows 3/2/2, odd width
        (3, (2, 48, 2, 4, 2), 1),  # rows 2/1/1, batch of 2
        (4, (1, 48, 2, 6, 2), 4),  # rows 2/2/1/1: halos at 1-row bands, more ranks than 2
    ],
    ids=["2ranks-H3", "3ranks-H7", "3ranks-H4-batch2", "4ranks-H6"],
)
def test_split_decode_equals_one_process_float64(tmp_path, world, shape, chunk):
    expected = _decoder().decode(_latents(shape), chunk)
    prefix = str(tmp_path / "rank")
    mp.spawn(
        _split_decode, args=(world, str(tmp_path / "init"), shape, chunk, prefix), nprocs=world, join=True
    )
    for rank in range(world):
        got = torch.load(f"{prefix}{rank}.pt", weights_only=True)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-9, f"rank {rank}"


def test_one_rank_split_is_the_zero_padded_decode():
    """A RowSplit over one rank has no neighbours: its halos are the reference's zero padding."""
    decoder = _decoder()
    z = _latents((1, 48, 2, 3, 4))
    expected = decoder.decode(z, 1)
    got = torch.cat(list(decoder.decode_chunks(z, 1, rows=RowSplit([3], 0))), dim=2)
    assert (got - expected).abs().max().item() <= 1e-12


def test_rows_are_split_contiguously_and_as_evenly_as_possible():
    assert split_rows(44, 2) == (22, 22)
    assert split_rows(44, 3) == (15, 15, 14)
    assert split_rows(7, 3) == (3, 2, 2)
    assert split_rows(3, 3) == (1, 1, 1)
    split = RowSplit(split_rows(44, 3), 2)
    assert (split.start, split.stop) == (30, 44)
    assert split.take(torch.zeros(1, 48, 1, 44, 78)).shape[-2] == 14
    with pytest.raises(InputError, match="cannot be split over 3"):
        split_rows(2, 3)


def test_halo_without_neighbours_pads_zeros():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    out = RowSplit([3], 0).halo(x, pad_w=1)
    assert torch.equal(out, torch.nn.functional.pad(x, (1, 1, 1, 1)))


def test_no_split_in_one_process_or_when_switched_off():
    assert row_split_for(44) is None
    assert row_split_for(44, enabled=False) is None
    assert distributed.agree_all(True) is True and distributed.agree_all(False) is False


def test_two_ranks_split_the_rows_unless_switched_off(monkeypatch):
    """In a process group of 2, the decode is split by rows, and `decode_kernel_parallel=False`
    still decodes whole frames (one process's check cannot see that: it returns None before the option)."""
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    rows = row_split_for(44)
    assert rows is not None and (rows.sizes, rows.rank, rows.start, rows.stop) == ((22, 22), 1, 22, 44)
    assert row_split_for(44, enabled=False) is None
    with pytest.raises(InputError, match="cannot be split over 2"):
        row_split_for(1)


def test_collective_timeout_defaults_to_300_s(monkeypatch):
    """`PAN2_DIST_TIMEOUT` (seconds) bounds every collective's wait; unset or empty: 300 s."""
    monkeypatch.delenv("PAN2_DIST_TIMEOUT", raising=False)
    assert protocol.collective_timeout() == timedelta(seconds=300)
    monkeypatch.setenv("PAN2_DIST_TIMEOUT", "")
    assert protocol.collective_timeout() == timedelta(seconds=300)


def test_collective_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAN2_DIST_TIMEOUT", "12.5")
    assert protocol.collective_timeout() == timedelta(seconds=12.5)


@pytest.mark.parametrize(
    "value, message",
    [("ten", "PAN2_DIST_TIMEOUT='ten' is not a number of seconds"), ("0", "PAN2_DIST_TIMEOUT='0' must be positive"),
     ("-5", "PAN2_DIST_TIMEOUT='-5' must be positive")],
)  # fmt: skip
def test_a_bad_collective_timeout_is_bad_input(monkeypatch, value, message):
    """A value that is no positive number of seconds is refused by name (exit 2), not replaced by the default."""
    monkeypatch.setenv("PAN2_DIST_TIMEOUT", value)
    with pytest.raises(InputError) as refused:
        protocol.collective_timeout()
    assert str(refused.value) == message and refused.value.exit_code == 2


def test_the_process_group_waits_the_collective_timeout(monkeypatch):
    """The timeout reaches `init_process_group`, which applies it to every collective of the group."""
    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, timeout=None, **kwargs):
        seen.update(backend=backend, timeout=timeout)
        raise Stop  # no group is joined: the test only looks at the arguments

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("PAN2_DIST_TIMEOUT", "42")
    with pytest.raises(Stop):
        with distributed.process_group("cpu"):
            pass
    assert seen == {"backend": "gloo", "timeout": timedelta(seconds=42)}


def test_decode_kernel_parallel_is_a_runtime_option():
    """The row split is `RuntimeConfig`'s (and `decode_latents`' `split_rows`), not the architecture's."""
    assert "decode_kernel_parallel" in {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert "decode_kernel_parallel" not in SMALL.to_diffusers_config()
    with pytest.raises(TypeError):
        WanVAEConfig(decode_kernel_parallel=True)


def test_strip_option_removes_both_spellings():
    args = ["decode", "a.pt", "--gpus", "2", "-o", "v.mp4", "--gpus=3", "--device", "cpu"]
    assert launcher.strip_option(args, "--gpus") == ["decode", "a.pt", "-o", "v.mp4", "--device", "cpu"]


def test_torchrun_environment_is_detected(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not protocol.under_torchrun()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not protocol.under_torchrun()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert protocol.under_torchrun() and protocol.env_rank() == 1 and protocol.env_world_size() == 2


def test_a_failing_launcher_is_one_error_line(run_cli, tiny_vae, latents_file, monkeypatch):
    def agent_fails(config):
        raise RuntimeError(
            "The server socket has failed to listen on any local network address.\nmore detail"
        )

    monkeypatch.setattr("torch.distributed.run.run", agent_fails)
    # launch() sets these for its workers: monkeypatch puts them back afterwards
    monkeypatch.setenv("PAN2_DIST_PARENT", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    result = run_cli("decode", latents_file((48, 1, 4, 2)), "--vae", tiny_vae, "--device", "cpu", "--gpus", 2)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: torchrun's agent could not run the 2 processes: "
        "The server socket has failed to listen on any local network address."
    ]


def _launch_refused(monkeypatch) -> list:
    """Replace pan2's launcher by a recorder that starts nothing; returns the list of its calls."""
    calls = []

    def launch_(nproc, args):
        calls.append((nproc, list(args)))
        return 0

    monkeypatch.setattr(launcher, "launch", launch_)
    return calls


def test_more_processes_than_latent_rows_fail_before_any_starts(run_cli, tiny_vae, latents_file, monkeypatch):
    """Refused before any process starts: `--gpus 16` on latents 8 rows high once failed only after all 16
    processes had started."""
    started = _launch_refused(monkeypatch)
    latents = latents_file((48, 1, 8, 2))
    result = run_cli("decode", latents, "--vae", tiny_vae, "--device", "cpu", "--gpus", 16)
    assert (result.exit_code, started) == (2, [])
    assert result.stderr.splitlines() == [
        "Error: latents of 8 rows cannot be split over 16 processes (at least one row each)",
        "Hint: use --gpus 8 or fewer",
    ]
    assert run_cli("decode", latents, "--vae", tiny_vae, "--device", "cpu", "--gpus", 8).exit_code == 0
    assert [nproc for nproc, _ in started] == [8]


def test_one_prompt_on_more_processes_than_latent_rows_fails_before_any_starts(run_cli, monkeypatch):
    """One prompt's decode is split by rows (a row per process, 16 pixels): checked before any process starts,
    unless --no-decode-kernel-parallel decodes whole frames on every rank."""
    started = _launch_refused(monkeypatch)
    command = ("generate", "a cat", "--device", "cpu", "--size", "64x96", "--frames", 5, "--gpus", 8)
    result = run_cli(*command)
    assert (result.exit_code, started) == (2, [])
    assert result.stderr.splitlines() == [
        "Error: a video 64 pixels high has 4 latent rows, too few to split its decode over 8 processes "
        "(one row each at least)",
        "Hint: pass --gpus 4 or fewer, a larger --size, or --no-decode-kernel-parallel",
    ]
    assert run_cli(*command, "--no-decode-kernel-parallel").exit_code == 0
    assert [nproc for nproc, _ in started] == [8]


def _failure(exitcode: int, timestamp: int = 100):
    """One of torchrun's per-rank failures (`ChildFailedError.failures`), as `launcher.exit_code_after_failure` reads it."""
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


@pytest.mark.parametrize(
    "exitcodes, recorded, hung, code, lines",
    [
        # Every rank chose 130 (signalled one by one): interrupted, not killed.
        ({0: 130, 1: 130}, {0: 130, 1: 130}, set(), 130, ["Interrupted."]),
        # Every rank lost contact: one line for all, no rank named as the one that died.
        ({0: 3, 1: 3}, {0: 3, 1: 3}, set(), 1, ["Error: the ranks lost contact with each other (a rank died, "
                                                 "or a collective waited longer than PAN2_DIST_TIMEOUT=300 s)"]),
        # A rank's recorded code wins over what torchrun saw (its SIGKILL after the code was written).
        ({0: -9, 1: 130}, {0: 130, 1: 130}, set(), 130, ["Interrupted."]),
        # The one that chose no code is the one that died.
        ({0: 130, 1: -9}, {0: 130}, set(), 1, ["Error: rank 1 was killed by signal 9 (SIGKILL)"]),
        # A hung rank that pan2 ended, after its peer's collective timed out.
        ({0: 4, 1: -9}, {0: 4}, {1}, 1, ["Error: rank 1 hung: rank 0 waited PAN2_DIST_TIMEOUT=300 s for it, "
                                         "and pan2 ended it",
                                         "Hint: if a step legitimately takes longer, raise PAN2_DIST_TIMEOUT "
                                         "(seconds, default 300)"]),
        # A timeout is the cause, the 130 of the rank torchrun then stopped its consequence.
        ({0: 4, 1: 130}, {0: 4, 1: 130}, set(), 1, ["Error: rank 0 waited longer than PAN2_DIST_TIMEOUT=300 s "
                                                    "for the other ranks"]),
    ],
    ids=["all-130", "all-lost-contact", "recorded-then-killed", "one-died", "hung", "timed-out"],
)  # fmt: skip
def test_ranks_that_chose_their_code_are_never_counted_as_killed(
    capsys, monkeypatch, exitcodes, recorded, hung, code, lines
):
    """A rank that recorded its own exit code is never counted as killed (a bug that once went unnoticed: every rank
    chose 130, or lost contact: "rank 0 exited with code 130 without an error message", exit 1)."""
    monkeypatch.delenv("PAN2_DIST_TIMEOUT", raising=False)
    failures = {rank: _failure(exitcode) for rank, exitcode in exitcodes.items()}
    assert launcher.exit_code_after_failure(failures, recorded, hung) == code
    assert capsys.readouterr().err.splitlines() == lines
