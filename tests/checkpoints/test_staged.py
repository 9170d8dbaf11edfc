"""`StagedReader` (pan2cli.checkpoints.staged): safetensors files read by several threads in chunks, on the CPU in
place and on CUDA through pinned buffers: the same bytes as safetensors' own reader, every tensor once, and
its failures (a bad header, a failed read, a caller that stops) reported with nothing left running."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan2cli.checkpoints import staged
from pan2cli.checkpoints.staged import StagedReader, TensorSpan, plan_chunks, safetensors_spans
from pan2cli.errors import CheckpointError

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(300, 37, generator=generator).to(torch.bfloat16),  # spans several chunks
        "f32": torch.randn(5, 7, generator=generator),
        "f16": torch.randn(11, generator=generator).half(),
        "fp8": torch.randn(6, 6, generator=generator).clamp(-400, 400).to(torch.float8_e4m3fn),
        "ids": torch.arange(9, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }


@pytest.fixture
def two_files(tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors(0), str(first))
    save_file({f"{key}.2": value for key, value in _tensors(1).items()}, str(second))
    files = {key: first for key in _tensors(0)} | {f"{key}.2": second for key in _tensors(1)}
    return files, {**load_file(str(first)), **load_file(str(second))}


def _reader_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith(f"{threading.current_thread().name}-reader")
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_bytes", [1000, 1 << 20])
def test_the_tensors_read_are_safetensors_own_bytes(two_files, device, chunk_bytes):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    files, expected = two_files
    ticks = []
    with StagedReader(files, device, readers=3, chunk_bytes=chunk_bytes) as reader:
        got = reader.read(list(files), on_tensor=lambda: ticks.append(1))
    assert set(got) == set(expected) and len(ticks) == len(expected)
    for key, tensor in got.items():
        assert tensor.device.type == device
        assert _same(tensor.cpu(), expected[key]), key
    assert not _reader_threads()


@pytest.mark.parametrize("device", DEVICES)
def test_a_flat_read_is_one_aligned_allocation_with_the_same_bytes(two_files, device):
    files, expected = two_files
    with StagedReader(files, device, readers=3, chunk_bytes=1000) as reader:
        got = reader.read(list(files), flat=True)
        apart = reader.read(list(files), flat=False)
    bases = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    separate = [t.untyped_storage().data_ptr() for t in apart.values() if t.numel()]
    assert len(bases) == 1 and len(set(separate)) == len(separate) > 1
    base = bases.pop()
    assert all((t.data_ptr() - base) % staged.ALIGN == 0 for t in got.values() if t.numel())
    for key, tensor in got.items():
        assert tensor.shape == expected[key].shape and _same(tensor.cpu(), expected[key]), key
    del apart
    if device == "cuda":  # a GPU's read() is flat unless told otherwise
        with StagedReader(files, device) as reader:
            default = reader.read(list(files))
        assert len({t.untyped_storage().data_ptr() for t in default.values() if t.numel()}) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_caller_in_inference_mode_gets_normal_tensors(two_files, device):
    """The threads write outside the caller's inference mode: the tensors must not be inference tensors."""
    files, expected = two_files
    with torch.inference_mode(), StagedReader(files, device, readers=2, chunk_bytes=1000) as reader:
        got = reader.read(list(files))
    assert not any(t.is_inference() for t in got.values())
    assert all(_same(t.cpu(), expected[k]) for k, t in got.items())


def test_only_the_keys_asked_for_are_read_and_a_second_read_works(two_files):
    files, expected = two_files
    with StagedReader(files, "cpu", chunk_bytes=512) as reader:
        first = reader.read(["big", "f16.2"])
        second = reader.read(["scalar"])
    assert set(first) == {"big", "f16.2"} and set(second) == {"scalar"}
    assert _same(first["big"], expected["big"]) and _same(second["scalar"], expected["scalar"])


def test_chunks_cover_every_byte_once_and_stay_under_their_size(two_files):
    files, _ = two_files
    spans = {}
    for path in set(files.values()):
        spans.update(safetensors_spans(path))
    chunks = plan_chunks(spans.items(), 1000)
    assert all(0 < chunk.length <= 1000 for chunk in chunks)
    covered = {key: 0 for key in spans}
    for chunk in chunks:
        at = 0
        for key, offset, within, nbytes in chunk.pieces:
            assert within == at and spans[key].path == chunk.path  # pieces tile their chunk in order
            assert offset == covered[key]  # and each tensor's bytes in order
            covered[key] += nbytes
            at += nbytes
        assert at == chunk.length
    assert covered == {key: span.end - span.begin for key, span in spans.items()}
    # Neighbouring small tensors share one read.
    assert any(len(set(chunk.keys)) > 2 for chunk in chunks)


def test_a_span_is_where_the_header_says():
    span = TensorSpan(path=None, dtype=torch.float32, shape=(2,), begin=10, end=18)
    assert plan_chunks([("x", span)], 4)[1].pieces == [("x", 4, 0, 4)]


@pytest.mark.parametrize(
    "content, why",
    [
        (b"", "is empty"),
        (b"\x10", "could not be read"),
        ((40).to_bytes(8, "little") + b"{not json", "could not be read"),
        ((2).to_bytes(8, "little") + b"[]", "could not be read"),
        # a header length beyond the file: a short, valid header after it must not be read as the header, and a
        # huge length must not be read at all (a MemoryError or OverflowError traceback)
        ((100).to_bytes(8, "little") + b"{}", "could not be read"),
        ((2**62).to_bytes(8, "little") + b"{}", "could not be read"),
        (
            (70).to_bytes(8, "little")
            + b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'.ljust(70)
            + b"\0" * 8,
            "could not be read",
        ),  # the header promises 16 bytes, the file holds 8
        (
            (70).to_bytes(8, "little")
            + b'{"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}'.ljust(70)
            + b"\0" * 4,
            "could not be read",
        ),
    ],
)
def test_a_bad_file_is_one_checkpoint_error_that_names_it(tmp_path, content, why):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=why) as caught:
        StagedReader({"x": path}, "cpu")
    assert str(path) in str(caught.value)


def test_a_failed_read_is_a_checkpoint_error_and_no_thread_is_left(two_files, monkeypatch):
    files, _ = two_files

    def broken(fd, buffers, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(staged.os, "preadv", broken)
    with pytest.raises(CheckpointError, match="could not be read: Input/output error"):
        with StagedReader(files, "cpu") as reader:
            reader.read(list(files))
    assert not _reader_threads()


def test_a_caller_that_stops_stops_the_reads(two_files, monkeypatch):
    files, _ = two_files
    reads = []
    real = StagedReader._read_chunk

    def counting(self, chunk, targets):
        reads.append(chunk)
        return real(self, chunk, targets)

    monkeypatch.setattr(StagedReader, "_read_chunk", counting)

    def stop():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with StagedReader(files, "cpu", readers=1, chunk_bytes=64) as reader:
            reader.read(list(files), on_tensor=stop)
    total = len(plan_chunks(reader.spans.items(), 64))
    assert len(reads) < total and not _reader_threads()


def test_groups_come_in_order_and_a_caller_that_breaks_off_can_read_again(two_files):
    files, expected = two_files
    groups = [["big"], ["f32", "f16"], ["scalar.2", "empty"]]
    with StagedReader(files, "cpu", chunk_bytes=256) as reader:
        got = list(reader.read_each(groups))
        assert [set(group) for group in got] == [set(group) for group in groups]
        assert all(_same(group[key], expected[key]) for group in got for key in group)
        for _ in reader.read_each(groups):
            break  # the next group's reads were queued: they are stopped and waited for
        assert reader.read(["ids"])["ids"].tolist() == list(range(9))
    assert not _reader_threads()
