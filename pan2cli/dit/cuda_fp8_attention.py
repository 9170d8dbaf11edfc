"""pan2's CUDA fp8 attention for Hopper (`kernels/fp8_attention/`): its extension, its instantiations, its launcher.

The fp8 tier's default joint attention on sm_90 GPUs (H100, H200) with head dim 128 (`fp8_attention_choice`),
with the Triton kernel's inputs (Q, K `[B, S, H, 128]` e4m3, V transposed `[B, H, 128, S_pad]` with one
descale per head) and output (bf16), written as FlashAttention-3 is: warp-specialised (a producer warpgroup
copies K/V tiles, two consumer warpgroups take turns at the wgmma MMAs so that one's softmax overlaps the
other's MMAs), P handed from the S accumulators to the P·V MMA in registers (the kernel's header says how).
Fourteen instantiations are compiled. With key tiles of 128 keys (each tile's P·V summed into O in float32):
3, 4 or 5 K/V stages in shared memory, the ping-pong schedule on or off, and two producers: cp.async by the
whole producer warpgroup (V in key order, K's rows permuted as they are copied), or TMA by one thread (V's
keys permuted instead, by `values_fp8(..., key_order="wgmma")`: `Instantiation.v_key_order` says which V to
make). With wide key tiles of 224 keys (FlashAttention-3's configuration for fp8; O accumulated in the tensor
core): TMA, three stages, ping-pong on or off, V smoothed (quantised less its mean over the tokens, which the
kernel adds back to its output: `Instantiation.smooth_v`; `values_for` makes the V an instantiation reads).

Which instantiation runs is `choose_instantiation` (GPU, joint token count): a table of the fastest measured,
with where each row was measured; `scripts/bench_kernels.py fp8-attention` times every instantiation and
prints the table's pick. The extension is built on first use (`pan2cli.kernel_build`), or by
`pan2 kernels build`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from pan2cli.errors import KernelBuildError
from pan2cli.kernel_build import ExtensionSpec, arch_flags, current_arch, load_extension, sources_in
from pan2cli.resources import kernels_dir

EXTENSION = "pan2_fp8_attention"
FOLDER = "fp8_attention"
ARCH = "sm_90a"  # wgmma and TMA: Hopper only (sm_100a has no wgmma)
HEAD_DIM = 128
STAGES = (3, 4, 5)  # K/V stages in shared memory the kernel is instantiated for (32 KiB each)
PRODUCERS = ("cp.async", "tma")
KEY_TILES = (128, 224)  # keys a tile; 224 with TMA and three stages only (60 KiB a stage)


@dataclass(frozen=True)
class Instantiation:
    """One compiled form of the kernel: `stages` K/V tiles in shared memory, the consumers' `ping_pong`
    schedule, the `producer` of the tiles ("cp.async" or "tma") and the `key_tile` (keys a tile)."""

    stages: int
    ping_pong: bool
    producer: str
    key_tile: int = 128

    def __post_init__(self) -> None:
        if self.stages not in STAGES or self.producer not in PRODUCERS or self.key_tile not in KEY_TILES:
            raise ValueError(
                f"no instantiation of {self.stages} stages with {self.producer} and {self.key_tile}-key tiles: "
                f"{STAGES} x {PRODUCERS} x {KEY_TILES}"
            )
        if self.key_tile != 128 and (self.producer != "tma" or self.stages != 3):
            raise ValueError(f"{self.key_tile}-key tiles come by TMA in three stages only")

    @property
    def tma(self) -> bool:
        return self.producer == "tma"

    @property
    def smooth_v(self) -> bool:
        """Whether V is quantised less its mean over the tokens (added back to the output): the wide tiles sum
        O across tiles in the fp8 MMA's accumulator, which loses bits once V's tokens share a part."""
        return self.key_tile != 128

    @property
    def v_key_order(self) -> str:
        """The `key_order` of `values_fp8` that this producer needs for its V."""
        return "wgmma" if self.tma else "natural"

    @property
    def name(self) -> str:
        wide = "" if self.key_tile == 128 else f"-k{self.key_tile}"
        return f"s{self.stages}-{'pingpong' if self.ping_pong else 'free'}-{self.producer}{wide}"

    def record(self) -> dict:
        """As the sidecar records it."""
        return {"stages": self.stages, "ping_pong": self.ping_pong, "producer": self.producer,
                "key_tile": self.key_tile}  # fmt: skip


INSTANTIATIONS = tuple(
    Instantiation(s, p, t) for t in PRODUCERS for s in STAGES for p in (True, False)
) + tuple(Instantiation(3, p, "tma", 224) for p in (True, False))

# The instantiation that runs, per GPU (a substring of its name) and joint token count (video + text): rows of
# (up to this many tokens, or None for any), first match wins, from `scripts/bench_kernels.py fp8-attention`.
# H100 80GB HBM3, 32 heads of 128, two runs on two machines: 2026-12-06 at 5b9e390, s4 free TMA the fastest
# of the 128-key tiles at 481 frames (104,118 tokens: 206.1 ms; the next 207.7) and at 121 (26,898: 13.65 ms;
# s3 ping-pong TMA 13.73, s3 free TMA 13.89; cuDNN fp8 13.46 there); the same day at e918a66, s4 free TMA again
# the fastest at 481 (206.8) and within 1 % of the fastest at 121 (s3 ping-pong TMA, 13.28). One instantiation
# for every length, then. Other sm_90 GPUs (H200, H800, GH200) take the H100's rows until they are measured.
# Then the wide tiles (224 keys), faster alone (11.80 against 13.69 ms at 121 frames, 189.3 against 209.4 at 481,
# same H100 and run, 8eeb667; free 3 % faster than ping-pong at 121, 1 % at 481) and in the step (2.619 against
# 2.739 s at 121 frames, one run). They sum O across tiles in the fp8 MMA's accumulator, which loses bits
# once V's tokens share a part: with V as it is the full model's velocity went from 5.0 % off bf16 to 12.6 %,
# with V smoothed it is 5.0 % again (`scripts/fp8_accuracy.py --full`, H100, 2026-12-06). They are the pick. The
# smoothing alone cost synthetic inputs whose V has no shared part some accuracy (the outlier suite's random case
# 0.058 against 0.053); with V's shift (`pan2cli.dit.fp8_values_kernel`) it is 0.0508, under the Triton kernel's
# (docs/BENCHMARKS.md, "fp8 attention on outlier inputs").
CHOICE_TABLE: dict[str, tuple[tuple[int | None, Instantiation], ...]] = {
    "H100": ((None, Instantiation(3, False, "tma", 224)),),
}
DEFAULT_GPU = "H100"  # the rows a GPU without its own takes


def table_gpu(gpu_name: str) -> str:
    """The `CHOICE_TABLE` key whose rows a GPU of this name (`torch.cuda.get_device_name`) takes."""
    return next((key for key in CHOICE_TABLE if key in gpu_name), DEFAULT_GPU)


def choose_instantiation(gpu_name: str, tokens: int) -> Instantiation:
    """The instantiation that runs on a GPU named `gpu_name` for `tokens` joint tokens (`CHOICE_TABLE`)."""
    for limit, instantiation in CHOICE_TABLE[table_gpu(gpu_name)]:
        if limit is None or tokens <= limit:
            return instantiation
    raise AssertionError("every row list of CHOICE_TABLE ends with a row for any count")


def extension_spec(arch: str = ARCH) -> ExtensionSpec:
    """The fp8 attention's build (its own extension, not the decode kernel's)."""
    return ExtensionSpec(
        name=EXTENSION,
        arch=arch,
        sources=sources_in(kernels_dir() / FOLDER),
        cuda_flags=tuple(arch_flags(arch)),
        what="pan2's CUDA fp8 attention",
        hint="set PAN2_KERNEL_VERBOSE=1 to see the compiler output; --fp8-attention triton runs the Triton kernel",
    )


def why_not_runnable(device: torch.device, head_dim: int) -> str | None:
    """None where the CUDA kernel can run a model on `device` with heads of `head_dim`, else why not."""
    if head_dim != HEAD_DIM:
        return f"its head dim is {HEAD_DIM}, the model's {head_dim}"
    if device.type != "cuda":
        return f"it needs an sm_90 GPU, this run is on the {device.type}"
    if current_arch(device) != ARCH:
        major, minor = torch.cuda.get_device_capability(device)
        return f"it runs on sm_90 GPUs (H100, H200), this one is sm_{major}{minor}"
    return None


_loaded: list[ModuleType] = []  # the extension, once loaded (one build serves every sm_90 GPU)


def extension_ops(device: torch.device) -> ModuleType:
    """The extension for `device` (built on first use; the binding refuses a GPU other than sm_90).

    Raises:
        KernelBuildError: not an sm_90 GPU, or the build failed (the first compiler error, the log's path).
    """
    if not _loaded:
        reason = why_not_runnable(device, HEAD_DIM)
        if reason is not None:
            raise KernelBuildError(f"pan2's CUDA fp8 attention cannot run here: {reason}")
        _loaded.append(load_extension(extension_spec()))
    return _loaded[0]


def cuda_fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
    qk_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    instantiation: Instantiation,
    v_mean: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q·Kᵀ/√128)·V from e4m3 inputs and their descales, no mask → `out` (bf16 `[B, S, H, 128]`).

    Args: as `fp8_attention_kernel.fp8_attention` (head dim 128 only; v_t's keys in `instantiation.v_key_order`),
    plus `instantiation` (`choose_instantiation`, or any of `INSTANTIATIONS`) and `v_mean` (`[B, H·128]`
    float32, added to the output: `values_fp8(..., mean=)` quantised V less it).
    """
    from pan2cli.dit.fp8 import P_SHIFT

    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    extension_ops(q.device).fp8_attention(
        q, k, v_t, qk_descale, v_descale, out, math.log2(math.e) / math.sqrt(HEAD_DIM), float(P_SHIFT),
        instantiation.stages, instantiation.ping_pong, instantiation.tma, instantiation.key_tile, v_mean,
    )  # fmt: skip
    return out


def values_for(
    instantiation: Instantiation, v_streams: list[torch.Tensor], heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """V's streams (`[B, n, H·128]`, video first) in e4m3 as `instantiation` reads them → (v_t `[B, H, 128,
    S_pad]` in its key order, the per-head descales `[H]`, and the shift `[B, H·128]` float32 where it is
    smoothed, else None: V's mean less its e4m3 rounding's, `values_fp8`'s `mean`): the arguments
    `cuda_fp8_attention` takes after Q and K."""
    from pan2cli.dit.fp8_values_kernel import transposed_values

    return transposed_values(
        v_streams, heads, key_order=instantiation.v_key_order, smooth=instantiation.smooth_v
    )


def build_status(device: torch.device | None = None) -> tuple[bool, str | None, str]:
    """(built, build folder, a line on it) for `pan2 kernels status`: whether this machine's GPU runs the kernel
    and whether its extension is built; nothing is built here."""
    device = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = why_not_runnable(device, HEAD_DIM)
    if reason is not None:
        return False, None, f"not built for this machine: {reason}"
    spec = extension_spec()
    if spec.library.exists():
        return True, str(spec.build_dir), "built, loads from the cache"
    return (
        False,
        str(spec.build_dir),
        "built on the first fp8 run, or now with `pan2 kernels build`",
    )
