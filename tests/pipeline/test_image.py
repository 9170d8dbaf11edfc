"""The start image's preparation (pan2cli/pipeline/image.py) on hand-made PNGs with hand-written expected pixels.

The release's recipe (`prepare_condition_latents` in vllm-project/vllm-omni
`vllm_omni/diffusion/models/pan2/pipeline_pan2.py`): scale to cover H x W (sizes rounded, LANCZOS),
centre crop at `round((w − W)/2)`, `round((h − H)/2)`, pixels `/255·2 − 1` in RGB order. The pictures are
made of flat colour bands, whose insides any resampling filter leaves exact, and of coordinate ramps
that are cropped without resampling, so every expected value is written here by hand: a crop from the
top-left corner, an RGB picture read as BGR, floor offsets or a "contain" resize fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pan2cli.pipeline.image import fit_image, load_image

BLUE, RED, SKY, GREEN = (0, 0, 255), (255, 0, 0), (51, 153, 204), (0, 255, 0)
# /255·2 − 1: 0 → −1, 51 → −0.6, 153 → 0.2, 204 → 0.6, 255 → 1
RED_PIXEL = [1.0, -1.0, -1.0]
SKY_PIXEL = [-0.6, 0.2, 0.6]


def _png(tmp_path, array: np.ndarray, name: str = "start.png"):
    from PIL import Image

    path = tmp_path / name
    Image.fromarray(array).save(path)
    return path


def _bands(vertical: bool) -> np.ndarray:
    """Four flat bands of 16 pixels (blue | red | sky | green) across a 16-pixel-thick strip: 16x64 or 64x16."""
    strip = np.zeros((16, 64, 3), np.uint8)
    for i, colour in enumerate((BLUE, RED, SKY, GREEN)):
        strip[:, 16 * i : 16 * (i + 1)] = colour
    return strip if vertical else strip.transpose(1, 0, 2).copy()


@pytest.mark.parametrize("vertical", [True, False], ids=["landscape", "portrait"])
def test_cover_resize_then_centre_crop_keeps_the_middle_bands_in_rgb(tmp_path, vertical):
    """Landscape: 64x16 (w x h) to 64 wide x 32 high: scale max(64/64, 32/16) = 2 → 128x32, left = round(64/2) = 32,
    so the crop holds resized columns 32…95 = source columns 16…47: the red band, then the sky band (a top-left
    crop would hold blue then red). Away from the band edges (LANCZOS rings for 3 source pixels = 6 output
    columns) every pixel is exact: red = (1, −1, −1), sky = (−0.6, 0.2, 0.6). Portrait: the same, transposed."""
    path = _png(tmp_path, _bands(vertical))
    height, width = (32, 64) if vertical else (64, 32)
    pixels = fit_image(load_image(path), height, width)
    assert pixels.shape == (3, height, width) and pixels.dtype == torch.float32
    along = pixels if vertical else pixels.transpose(1, 2)  # (3, 32, 64): the band axis last
    red = along[:, :, 8:26]  # output 8…25 = resized 40…57, inside the red band (resized 32…63)
    sky = along[:, :, 40:57]  # output 40…56 = resized 72…88, inside the sky band (resized 64…95)
    torch.testing.assert_close(red, torch.tensor(RED_PIXEL)[:, None, None].expand_as(red), rtol=0, atol=1e-6)
    torch.testing.assert_close(sky, torch.tensor(SKY_PIXEL)[:, None, None].expand_as(sky), rtol=0, atol=1e-6)
    assert pixels.min().item() >= -1.0 and pixels.max().item() <= 1.0


@pytest.mark.parametrize(
    ("source", "target"), [((11, 11), (15, 15)), ((3, 7), (16, 61)), ((64, 64), (16, 16))]
)
def test_a_flat_picture_covers_the_whole_frame(tmp_path, source, target):
    """The resized picture covers H x W: 11 · (15/11) and 7 · (61/7) are 14.999… and 60.999… in floating point: rounded to 15
    and 61 (truncated they would leave a black row or column in the crop); a 4x downscale too. LANCZOS keeps
    a flat colour exact, so every pixel is the sky colour (−0.6, 0.2, 0.6)."""
    array = np.zeros((*source, 3), np.uint8) + np.array(SKY, np.uint8)
    pixels = fit_image(load_image(_png(tmp_path, array)), *target)
    expected = torch.tensor(SKY_PIXEL)[:, None, None].expand(3, *target)
    torch.testing.assert_close(pixels, expected, rtol=0, atol=1e-6)


def _ramp(height: int, width: int) -> np.ndarray:
    """Pixel (y, x) = (R 20·x, G 40·y + 10, B 200): every value says where it came from."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([20 * x, 40 * y + 10, np.full_like(x, 200)], axis=-1).astype(np.uint8)


@pytest.mark.parametrize(
    ("source", "target", "columns", "rows"),
    [
        # width 11 → 4: round(7/2) = round(3.5) = 4 (floor would give 3); height kept (scale max(4/11, 4/4) = 1)
        ((4, 11), (4, 4), [4, 5, 6, 7], [0, 1, 2, 3]),
        # width 10 → 4: round(6/2) = 3 (a top-left crop gives 0)
        ((4, 10), (4, 4), [3, 4, 5, 6], [0, 1, 2, 3]),
        # width 9 → 4: round(5/2) = round(2.5) = 2, Python's halves to even
        ((4, 9), (4, 4), [2, 3, 4, 5], [0, 1, 2, 3]),
        # height 6 → 2: round(4/2) = 2 rows off the top; height 5 → 2: round(1.5) = 2 (floor would give 1)
        ((6, 3), (2, 3), [0, 1, 2], [2, 3]),
        ((5, 3), (2, 3), [0, 1, 2], [2, 3]),
    ],
)
def test_crop_offsets_are_rounded_halves_of_the_excess(tmp_path, source, target, columns, rows):
    """One side already fits (scale 1, no resampling): the crop alone moves pixels, so they are exact."""
    path = _png(tmp_path, _ramp(*source))
    pixels = fit_image(load_image(path), *target)
    red = [20 * x for x in columns]
    green = [40 * y + 10 for y in rows]
    expected = torch.tensor(
        [
            [[r for r in red] for _ in green],
            [[g for _ in red] for g in green],
            [[200 for _ in red] for _ in green],
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(pixels, expected / 255.0 * 2.0 - 1.0, rtol=0, atol=1e-6)


def test_load_image_gives_rgb_from_rgba_grey_and_palette_files(tmp_path):
    """A PNG's red stays channel 0 whatever its mode: RGBA (alpha dropped), palette; grey gives three equal channels."""
    from PIL import Image

    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[...] = (255, 0, 0, 128)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    Image.fromarray(np.zeros((2, 2, 3), np.uint8) + np.array(RED, np.uint8)).convert("P").save(
        tmp_path / "p.png"
    )
    Image.fromarray(np.full((2, 2), 51, np.uint8), "L").save(tmp_path / "grey.png")
    for name in ("rgba.png", "p.png"):
        image = load_image(tmp_path / name)
        assert image.mode == "RGB" and np.asarray(image)[0, 0].tolist() == [255, 0, 0], name
    assert np.asarray(load_image(tmp_path / "grey.png"))[1, 1].tolist() == [51, 51, 51]


@pytest.mark.parametrize(
    ("height", "width", "ok"), [(1, 1, False), (15, 64, False), (64, 15, False), (16, 16, True)]
)
def test_a_start_image_smaller_than_a_latent_pixel_is_refused(tmp_path, height, width, ok):
    """A 1x1 start image was once taken without a word (cover-resized into a flat first frame). Below 16 pixels
    on a side (one latent pixel of the VAE) it holds no picture: bad input, named as the caller names the image."""
    from pan2cli.errors import InputError
    from pan2cli.pipeline.image import load_start_image

    path = _png(tmp_path, np.zeros((height, width, 3), np.uint8) + np.array(SKY, np.uint8))
    if ok:
        assert load_start_image(path).size == (width, height)
        return
    with pytest.raises(
        InputError, match=rf"^'image' {path} is {width}x{height} pixels: a start image needs at least 16x16"
    ):
        load_start_image(path, "'image'")
    assert load_image(path).size == (width, height)  # the reader itself takes any size
