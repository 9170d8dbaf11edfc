"""The transformer read in the background while the text encoder loads and encodes (`pan2cli.pipeline.background`,
`ModelStages._start_transformer_load`): that it overlaps, what the sidecar says of it, the one-line fallback,
and its failure paths (a transformer file that fails to read, Ctrl-C): one clear error or exit 130, nothing
written, no thread left behind."""

from __future__ import annotations

import json
import threading
import time

import pytest

import pan2cli.checkpoints.staged as staged
import pan2cli.dit.checkpoint as dit_checkpoint
from pan2cli.checkpoints.staged import StagedReader
from pan2cli.errors import CheckpointError
from pan2cli.pipeline import generator as generator_module
from pan2cli.pipeline import loading
from pan2cli.pipeline.background import BackgroundLoad, LoadCancelled
from pan2cli.text.encoder import PAN2TextEncoder

CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x96", "--device", "cpu")
THREAD = "pan2-transformer-load"


def _loader_threads() -> list[threading.Thread]:
    """The loader's thread and its reading threads (named after it)."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD)]


def _wrap_reader(monkeypatch, on_read):
    """Make the transformer's readers call `on_read(key)` before reading each tensor (the real read follows; the
    text encoder's reads are left alone); chunks of 4 KiB, so that a chunk holds about one tensor of the tiny
    model and large ones span chunks."""
    real = StagedReader._read_chunk

    def read_chunk(self, chunk, targets):
        if chunk.path.parent.name == "transformer":
            for key in dict.fromkeys(chunk.keys):
                on_read(key)
        return real(self, chunk, targets)

    monkeypatch.setattr(StagedReader, "_read_chunk", read_chunk)
    monkeypatch.setattr(staged, "CHUNK_BYTES", 4096)


def _wrap_encode(monkeypatch, before):
    """Make every prompt's encoding call `before()` first."""
    real = PAN2TextEncoder.encode

    def encode(self, prompt):
        before()
        return real(self, prompt)

    monkeypatch.setattr(PAN2TextEncoder, "encode", encode)


# -- BackgroundLoad ---------------------------------------------------------------------------------
def test_a_background_load_hands_over_its_result_and_its_ticks():
    def load(tick):
        for _ in range(5):
            tick()
        return "model"

    import torch

    background = BackgroundLoad(load, torch.device("cpu"), name="t-ok")
    ticks = []
    background.wait(on_tick=ticks.append)
    assert background.result() == "model" and sum(ticks) == 5 and background.seconds is not None


def test_a_failed_background_load_raises_in_the_caller_and_cancel_stops_it_within_a_tick():
    import torch

    failing = BackgroundLoad(lambda tick: (_ for _ in ()).throw(OSError("disk gone")), torch.device("cpu"))
    failing.wait()
    with pytest.raises(OSError, match="disk gone"):
        failing.check()
    with pytest.raises(OSError, match="disk gone"):
        failing.result()

    started = threading.Event()

    def endless(tick):
        started.set()
        while True:
            tick()
            time.sleep(0.01)

    looping = BackgroundLoad(endless, torch.device("cpu"), name="t-loop")
    assert started.wait(10)
    begin = time.perf_counter()
    looping.cancel()
    assert looping.done and time.perf_counter() - begin < 5
    looping.check()  # a cancelled load is no error of the caller's
    with pytest.raises(LoadCancelled):
        looping.result()


def test_leaving_the_with_block_on_an_error_cancels_the_load():
    import torch

    def endless(tick):
        while True:
            tick()
            time.sleep(0.01)

    with pytest.raises(RuntimeError, match="caller"):
        with BackgroundLoad(endless, torch.device("cpu"), name="t-with") as background:
            raise RuntimeError("caller failed")
    assert background.done


def test_a_load_after_another_starts_when_that_one_has_ended():
    import torch

    release, order = threading.Event(), []

    def first(tick):
        release.wait(10)
        order.append("first ended")
        return 1

    def second(tick):
        order.append("second started")
        return 2

    with BackgroundLoad(first, torch.device("cpu"), name="t-first") as a:
        with BackgroundLoad(second, torch.device("cpu"), name="t-second", after=a) as b:
            time.sleep(0.1)
            assert order == [] and not b.done  # waiting for `a`
            release.set()
            assert (a.result(), b.result()) == (1, 2)
    assert order == ["first ended", "second started"]


def test_cancelling_a_load_that_waits_for_another_ends_it_at_once():
    import torch

    release = threading.Event()
    with BackgroundLoad(lambda tick: release.wait(10), torch.device("cpu"), name="t-slow") as a:
        b = BackgroundLoad(lambda tick: pytest.fail("started"), torch.device("cpu"), name="t-after", after=a)
        begin = time.perf_counter()
        b.cancel()
        assert b.done and time.perf_counter() - begin < 1 and not a.done
        with pytest.raises(LoadCancelled):
            b.result()
        release.set()


# -- in the pipeline --------------------------------------------------------------------------------
def test_the_transformer_is_read_while_the_prompts_are_encoded(tiny_pan2, run_cli, tmp_path, monkeypatch):
    reading = threading.Event()
    threads = set()

    def on_read(key):
        threads.add(threading.current_thread().name)
        reading.set()

    _wrap_reader(monkeypatch, on_read)
    waited = []
    _wrap_encode(monkeypatch, lambda: waited.append(reading.wait(10)))  # a sequential load would never set it
    out = tmp_path / "cat.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert waited and all(waited) and threads and all(name.startswith(f"{THREAD}-reader") for name in threads)
    side = json.loads(out.with_suffix(".json").read_text())
    load = side["shared_loads"]["load_transformer"]
    assert load["overlapped_with"] == ["load_text_encoder", "text_encoding"] and load["videos"] == 1
    assert 0 <= load["waited"] <= load["seconds"] + 1
    # Counted from the command's start (here the test process's), so past the text encoding at least.
    assert side["time_to_first_step_from"] == "command start"
    assert side["time_to_first_step"] > side["seconds"]["text_encoding"]
    assert not _loader_threads()


def test_the_transformer_read_starts_after_the_text_encoders(tiny_pan2, run_cli, tmp_path, monkeypatch):
    """The text encoder's read is the one the first step waits for, and two reads at once share the host's
    bandwidth: the transformer's background read starts when the text encoder's has ended (`after=`), never at
    once. The text encoder's reads are slowed here so that a transformer read started at once would come first."""
    order = []
    real = StagedReader._read_chunk

    def read_chunk(self, chunk, targets):
        component = chunk.path.parent.name
        if component == "text_encoder":
            time.sleep(0.3)  # the transformer's loader, if it ran beside, reads meanwhile
        order.append(component)
        return real(self, chunk, targets)

    monkeypatch.setattr(StagedReader, "_read_chunk", read_chunk)
    out = tmp_path / "cat.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert "text_encoder" in order and "transformer" in order
    last_text = max(i for i, component in enumerate(order) if component == "text_encoder")
    assert order.index("transformer") > last_text, order
    load = json.loads(out.with_suffix(".json").read_text())["shared_loads"]["load_transformer"]
    assert load["overlapped_with"] == ["load_text_encoder", "text_encoding"]  # still in the background


def test_time_to_first_step_counts_from_the_commands_start(tiny_pan2, tmp_path):
    """The CLI sets `clock_start` to the process's start: the first step is measured from there, not from the
    batch's start (which comes after the imports and the checks). A command that started 100 s before its batch
    shows more than 100 s."""
    from pan2cli.config import RuntimeConfig
    from pan2cli.pipeline import VideoGenerator

    generator = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))
    generator.clock_start = time.perf_counter() - 100.0
    out = tmp_path / "cat.mp4"
    generator.generate("a cat", preset="pan2-5s", steps=1, frames=5, height=64, width=64, output=out)
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["time_to_first_step_from"] == "command start"
    assert 100.0 < side["time_to_first_step"] < 100.0 + 120


@pytest.mark.parametrize("why", ["no room", "offload"])
def test_without_room_or_with_offload_the_loads_run_one_after_the_other_said_in_one_line(
    why, tiny_pan2, run_cli, tmp_path, monkeypatch
):
    if why == "no room":
        monkeypatch.setattr(loading, "free_memory", lambda device: (2**20, "the GPU"))
    threads = set()
    _wrap_reader(monkeypatch, lambda key: threads.add(threading.current_thread().name))
    out = tmp_path / "cat.mp4"
    extra = ["--offload"] if why == "offload" else []
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, *extra, "-o", out)
    assert res.exit_code == 0, res.stderr
    lines = [
        line for line in res.stderr.splitlines() if "Loading the transformer after the text encoder" in line
    ]
    assert len(lines) == 1
    assert (
        ("both need" in lines[0] and "the GPU has 0.0 GiB free" in lines[0])
        if why == "no room"
        else "--offload" in lines[0]
    )
    main = threading.main_thread().name
    assert threads and all(name.startswith(f"{main}-reader") for name in threads)  # none in the background
    load = json.loads(out.with_suffix(".json").read_text())["shared_loads"]["load_transformer"]
    assert "overlapped_with" not in load


def test_a_transformer_file_that_fails_to_read_while_the_text_encoder_runs(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    failed = threading.Event()
    victim = "transformer_blocks.0.attn.to_q.weight"

    def on_read(key):
        if key == victim:
            failed.set()
            raise CheckpointError(f"{tiny_pan2}/transformer: cannot read {key} (Input/output error)")

    _wrap_reader(monkeypatch, on_read)
    _wrap_encode(monkeypatch, lambda: failed.wait(10))
    monkeypatch.setattr(
        generator_module.VideoGenerator,
        "sample",
        lambda *a, **k: pytest.fail("sampled without a transformer"),
    )
    out = tmp_path / "cat.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == CheckpointError.exit_code
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert errors == [f"Error: {tiny_pan2}/transformer: cannot read {victim} (Input/output error)"]
    assert list(tmp_path.iterdir()) == [] and not _loader_threads()


def test_a_text_encoder_file_that_fails_to_read_in_the_background(tiny_pan2, run_cli, tmp_path, monkeypatch):
    real = StagedReader._read_chunk

    def read_chunk(self, chunk, targets):
        if chunk.path.parent.name == "text_encoder":
            raise CheckpointError(f"{chunk.path} could not be read: Input/output error")
        return real(self, chunk, targets)

    monkeypatch.setattr(StagedReader, "_read_chunk", read_chunk)
    out = tmp_path / "cat.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == CheckpointError.exit_code
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error:")]
    assert (
        len(errors) == 1
        and "text_encoder/model.safetensors could not be read: Input/output error" in errors[0]
    )
    assert list(tmp_path.iterdir()) == []
    assert not [t for t in threading.enumerate() if t.name.startswith(("pan2-text-encoder-read", THREAD))]


def test_ctrl_c_during_the_overlapped_load_exits_130_and_leaves_nothing(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    reads = []

    def slow_read(key):
        reads.append(key)
        time.sleep(0.02)  # the loader is still reading when the prompt's encoding is interrupted

    _wrap_reader(monkeypatch, slow_read)

    def interrupt():
        while not reads:
            time.sleep(0.01)
        raise KeyboardInterrupt

    _wrap_encode(monkeypatch, interrupt)
    out = tmp_path / "cat.mp4"
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 130 and "Interrupted." in res.stderr
    assert list(tmp_path.iterdir()) == [] and not _loader_threads()
    total = len(dit_checkpoint.resolve_pan2_checkpoint(tiny_pan2).shapes)
    settled = len(reads)
    time.sleep(0.2)
    assert settled == len(reads) < total  # the load stopped with the command and read no more


def test_through_the_api_time_to_first_step_counts_from_the_batch(tiny_pan2, tmp_path):
    from pan2cli.config import RuntimeConfig
    from pan2cli.pipeline import VideoGenerator

    generator = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))
    out = tmp_path / "cat.mp4"
    begin = time.perf_counter()
    result = generator.generate("a cat", preset="pan2-5s", steps=1, frames=5, height=64, width=96, output=out)
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["time_to_first_step_from"] == "batch start"
    assert result.seconds["text_encoding"] < side["time_to_first_step"] < time.perf_counter() - begin


def test_the_first_step_benchmark_reads_the_figures_back(tiny_pan2, tmp_path, capsys):
    """scripts/bench_first_step.py (the issue's benchmark, run on a GPU with the full-size repository) on the tiny
    repository: a fresh `pan2 generate` process, its time to the first step and the overlapped load, the load
    rate beside safetensors', from a warm and a dropped page cache."""
    from scripts import bench_first_step

    out = tmp_path / "first_step.json"
    bench_first_step.main(
        [
            "--model",
            str(tiny_pan2),
            "--device",
            "cpu",
            "--size",
            "64x96",
            "--frames",
            "5",
            "--load-rate",
            "--out",
            str(out),
        ]
    )
    results = json.loads(out.read_text())
    (run,) = results["runs"]
    assert "error" not in run, run
    assert run["from"] == "command start" and 0 < run["time_to_first_step_s"] < run["wall_s"]
    assert run["shared_loads"]["load_transformer"]["overlapped_with"] == [
        "load_text_encoder",
        "text_encoding",
    ]
    (rates,) = results["load_rates"]
    assert rates["cold"] is False and rates["file_mb"] >= 0
    assert all(
        isinstance(rates[k], (int, float)) for k in ("pan2_s", "pan2_mb_per_s", "safetensors_mb_per_s")
    )
    assert "| bf16 | warm |" in capsys.readouterr().out
