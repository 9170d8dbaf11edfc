"""Tests for pan2cli.latents: accepted file layouts, every rejected input, (un)normalize."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import safetensors.torch
import torch

from pan2cli.constants import LATENT_CHANNELS
from pan2cli.errors import InputError
from pan2cli.latents import LatentInput, load_latents, normalize, unnormalize

C = LATENT_CHANNELS


def _latents(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=g).to(dtype)


class _NotATensor:
    """A custom class that weights_only=True must refuse to unpickle."""

    def __init__(self) -> None:
        self.value = 3


# ---------------------------------------------------------------- accepted layouts


def test_4d_tensor_gets_batch_dim(tmp_path: Path) -> None:
    z = _latents(C, 2, 3, 4)
    path = tmp_path / "z.pt"
    torch.save(z, path)
    out = load_latents(path)
    assert isinstance(out, LatentInput)
    assert out.path == path
    assert out.fps is None
    assert out.latents.shape == (1, C, 2, 3, 4)
    assert out.latents.dtype == torch.float32
    assert out.latents.is_contiguous()
    torch.testing.assert_close(out.latents[0], z, rtol=0, atol=0)


def test_5d_tensor_and_pth_suffix(tmp_path: Path) -> None:
    z = _latents(2, C, 1, 2, 3)
    path = tmp_path / "z.pth"
    torch.save(z, path)
    torch.testing.assert_close(load_latents(path).latents, z, rtol=0, atol=0)


def test_half_precision_becomes_float32(tmp_path: Path) -> None:
    z = _latents(C, 1, 2, 2, dtype=torch.bfloat16)
    path = tmp_path / "z.pt"
    torch.save(z, path)
    out = load_latents(path).latents
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], z.float(), rtol=0, atol=0)


def test_non_contiguous_tensor_becomes_contiguous(tmp_path: Path) -> None:
    z = _latents(C, 3, 2, 5).transpose(2, 3)  # [C, 3, 5, 2], not contiguous
    path = tmp_path / "z.pt"
    torch.save(z, path)
    out = load_latents(path).latents
    assert out.is_contiguous()
    torch.testing.assert_close(out[0], z, rtol=0, atol=0)


@pytest.mark.parametrize("fps", [24, 12.5, torch.tensor(16.0), torch.tensor(30)])
def test_dict_with_fps(tmp_path: Path, fps: object) -> None:
    z = _latents(C, 2, 2, 2)
    path = tmp_path / "z.pt"
    torch.save({"latents": z, "fps": fps}, path)
    out = load_latents(path)
    torch.testing.assert_close(out.latents[0], z, rtol=0, atol=0)
    assert out.fps == pytest.approx(float(fps))
    assert isinstance(out.fps, float)


def test_dict_without_fps(tmp_path: Path) -> None:
    z = _latents(1, C, 2, 2, 2)
    path = tmp_path / "z.pt"
    torch.save({"latents": z, "prompt_id": 7}, path)
    out = load_latents(path)
    assert out.fps is None
    torch.testing.assert_close(out.latents, z, rtol=0, atol=0)


def test_safetensors_with_fps(tmp_path: Path) -> None:
    z = _latents(C, 2, 3, 2)
    path = tmp_path / "z.safetensors"
    safetensors.torch.save_file({"latents": z, "other": torch.ones(2)}, str(path), metadata={"fps": "24"})
    out = load_latents(path)
    assert out.fps == 24.0
    assert out.latents.shape == (1, C, 2, 3, 2)
    torch.testing.assert_close(out.latents[0], z, rtol=0, atol=0)


def test_safetensors_without_fps(tmp_path: Path) -> None:
    z = _latents(2, C, 1, 2, 2)
    path = tmp_path / "z.safetensors"
    safetensors.torch.save_file({"latents": z}, str(path))
    out = load_latents(path)
    assert out.fps is None
    torch.testing.assert_close(out.latents, z, rtol=0, atol=0)


def test_other_channel_count_when_asked(tmp_path: Path) -> None:
    z = _latents(16, 2, 2, 2)
    path = tmp_path / "z.pt"
    torch.save(z, path)
    assert load_latents(path, channels=16).latents.shape == (1, 16, 2, 2, 2)


# ---------------------------------------------------------------- rejected inputs


def _save(tmp_path: Path, obj: object, name: str = "bad.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


def _raises(path: Path, *fragments: str) -> InputError:
    with pytest.raises(InputError) as info:
        load_latents(path)
    msg = str(info.value)
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, msg
    assert info.value.exit_code == 2
    return info.value


def test_missing_file(tmp_path: Path) -> None:
    _raises(tmp_path / "nope.pt", "does not exist")


def test_folder(tmp_path: Path) -> None:
    (tmp_path / "dir.pt").mkdir()
    _raises(tmp_path / "dir.pt", "folder")


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _raises(path, "empty")


def test_text_file_named_pt(tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("these are not latents\n")
    _raises(path, "could not be read", "truncated or not a latents file")


def test_random_bytes_named_pt(tmp_path: Path) -> None:
    path = tmp_path / "noise.pt"
    path.write_bytes(bytes(range(256)) * 4)
    _raises(path, "could not be read")


def test_truncated_pt(tmp_path: Path) -> None:
    good = _save(tmp_path, _latents(C, 2, 4, 4), "good.pt").read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(good[: len(good) // 2])
    _raises(path, "could not be read")


def test_truncated_safetensors(tmp_path: Path) -> None:
    good = tmp_path / "good.safetensors"
    safetensors.torch.save_file({"latents": _latents(C, 2, 4, 4)}, str(good), metadata={"fps": "24"})
    data = good.read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data[: len(data) // 2])
    _raises(path, "could not be read", "truncated or not a latents file")


def test_text_file_named_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "notes.safetensors"
    path.write_text("these are not latents either\n")
    _raises(path, "could not be read")


def test_safetensors_without_latents_key(tmp_path: Path) -> None:
    path = tmp_path / "z.safetensors"
    safetensors.torch.save_file({"z": _latents(C, 1, 2, 2)}, str(path))
    _raises(path, "no tensor named 'latents'", "'z'")


@pytest.mark.parametrize("fps", ["abc", "0", "-5", "nan"])
def test_safetensors_bad_fps_metadata(tmp_path: Path, fps: str) -> None:
    path = tmp_path / "z.safetensors"
    safetensors.torch.save_file({"latents": _latents(C, 1, 2, 2)}, str(path), metadata={"fps": fps})
    _raises(path, "fps")


def test_pickled_custom_object(tmp_path: Path) -> None:
    path = _save(tmp_path, _NotATensor())
    _raises(path, "holds objects other than plain tensors", "weights_only=True")


def test_custom_object_inside_dict(tmp_path: Path) -> None:
    path = _save(tmp_path, {"latents": _latents(C, 1, 2, 2), "extra": _NotATensor()})
    _raises(path, "holds objects other than plain tensors")


def test_a_plain_pickle_gets_our_error_without_torchs_warning(tmp_path: Path) -> None:
    """A file written by `pickle.dump` (protocol 4, not torch.save's 2) made torch print a two-line
    UserWarning about the protocol before pan2's one-line error."""
    import pickle
    import warnings

    path = tmp_path / "plain.pt"
    path.write_bytes(pickle.dumps({"latents": 1}, protocol=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _raises(path, "could not be read")
    assert [str(w.message) for w in caught] == []


def test_pickled_counter(tmp_path: Path) -> None:
    # weights_only=True allows Counter (a dict subclass), so this fails as a dict without latents.
    path = _save(tmp_path, collections.Counter(a=1, b=2))
    _raises(path, "without a 'latents' key")


def test_dict_without_latents(tmp_path: Path) -> None:
    path = _save(tmp_path, {"z": _latents(C, 1, 2, 2), "fps": 24})
    _raises(path, "without a 'latents' key", "'z'")


@pytest.mark.parametrize("obj", [[1.0, 2.0], 3.5, "latents"])
def test_not_a_tensor(tmp_path: Path, obj: object) -> None:
    _raises(_save(tmp_path, obj), "not a latents tensor")


@pytest.mark.parametrize(
    "fps", [0, -1.0, float("nan"), float("inf"), torch.tensor(0.0), torch.tensor([24.0]), "24", True]
)
def test_bad_fps_in_dict(tmp_path: Path, fps: object) -> None:
    _raises(_save(tmp_path, {"latents": _latents(C, 1, 2, 2), "fps": fps}), "fps")


@pytest.mark.parametrize("shape", [(C,), (C, 2, 2), (1, 1, C, 2, 2, 2)])
def test_wrong_rank(tmp_path: Path, shape: tuple[int, ...]) -> None:
    _raises(
        _save(tmp_path, _latents(*shape)), str(list(shape)), f"expected [{C}, T, H, W] or [B, {C}, T, H, W]"
    )


@pytest.mark.parametrize("shape", [(16, 2, 2, 2), (1, 47, 2, 2, 2)])
def test_wrong_channels(tmp_path: Path, shape: tuple[int, ...]) -> None:
    _raises(_save(tmp_path, _latents(*shape)), "channels", str(list(shape)))


def test_btchw_layout_gets_a_hint(tmp_path: Path) -> None:
    err = _raises(_save(tmp_path, _latents(1, 3, C, 2, 2)), "channels")
    assert err.hint is not None and "permute" in err.hint


@pytest.mark.parametrize("shape", [(C, 0, 2, 2), (C, 2, 0, 2), (C, 2, 2, 0), (0, C, 1, 1, 1)])
def test_empty_dimension(tmp_path: Path, shape: tuple[int, ...]) -> None:
    _raises(_save(tmp_path, torch.empty(*shape)), "empty dimension")


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_non_float_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    z = (torch.rand(C, 1, 2, 2, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)
    _raises(_save(tmp_path, z), "dtype", str(dtype))


def test_nan_values_are_counted(tmp_path: Path) -> None:
    z = _latents(C, 1, 2, 2)
    z[3, 0, 1, 1] = float("nan")
    z[5, 0, 0, 0] = float("nan")
    _raises(_save(tmp_path, z), "2 NaN", "0 Inf")


def test_inf_values_are_counted(tmp_path: Path) -> None:
    z = _latents(1, C, 1, 2, 2)
    z[0, 7, 0, 1, 0] = float("inf")
    z[0, 8, 0, 0, 1] = float("-inf")
    z[0, 9, 0, 0, 0] = float("inf")
    _raises(_save(tmp_path, z), "0 NaN", "3 Inf")


def test_float64_overflowing_float32_is_inf(tmp_path: Path) -> None:
    z = _latents(C, 1, 2, 2, dtype=torch.float64)
    z[0, 0, 0, 0] = 1e300
    _raises(_save(tmp_path, z), "1 Inf")


def test_nan_in_safetensors(tmp_path: Path) -> None:
    z = _latents(C, 1, 2, 2)
    z[0, 0, 0, 0] = float("nan")
    path = tmp_path / "z.safetensors"
    safetensors.torch.save_file({"latents": z}, str(path))
    _raises(path, "1 NaN")


# ---------------------------------------------------------------- (un)normalize


def test_unnormalize_matches_per_channel_formula() -> None:
    z = _latents(2, C, 2, 3, 2)
    mean = [0.1 * i - 2.0 for i in range(C)]
    std = [0.5 + 0.05 * i for i in range(C)]
    out = unnormalize(z, mean, std)
    assert out.shape == z.shape and out.dtype == z.dtype
    for c in range(C):
        # measured 4.8e-7 (half an fp32 step of |z·std| <= 10: one rounding fewer when addcmul fuses); 2e-6
        # holds for a fused or unfused add on any CPU (the default bound was 1e-5 + 1.3e-6·|x|)
        torch.testing.assert_close(out[:, c], z[:, c] * std[c] + mean[c], rtol=0, atol=2e-6)


def test_normalize_inverts_unnormalize() -> None:
    z = _latents(1, C, 2, 2, 2, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(C, generator=g, dtype=torch.float64)
    std = torch.rand(C, generator=g, dtype=torch.float64) + 0.5
    # measured 5.0e-16 both ways (|z| < 3.4, a few fp64 steps); the default bound was 1e-7 + 1e-7·|z|
    torch.testing.assert_close(normalize(unnormalize(z, mean, std), mean, std), z, rtol=0, atol=1e-13)
    torch.testing.assert_close(unnormalize(normalize(z, mean, std), mean, std), z, rtol=0, atol=1e-13)


def test_unnormalize_keeps_dtype() -> None:
    z = _latents(1, C, 1, 2, 2, dtype=torch.bfloat16)
    out = unnormalize(z, torch.zeros(C), torch.full((C,), 2.0))
    assert out.dtype == torch.bfloat16
    # z·2 + 0 is exact in bf16 (measured 0; the default bf16 bound was 1.6e-2·|z|)
    torch.testing.assert_close(out, z * 2, rtol=0, atol=0)


def test_unnormalize_rejects_bad_stats() -> None:
    z = _latents(1, C, 1, 2, 2)
    with pytest.raises(ValueError):
        unnormalize(z, [0.0] * (C - 1), [1.0] * C)
    with pytest.raises(ValueError):
        unnormalize(z[0], [0.0] * C, [1.0] * C)
    with pytest.raises(ValueError):
        normalize(z, [0.0] * C, [1.0] * (C - 1) + [0.0])
