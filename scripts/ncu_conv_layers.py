"""Two of the decoder's largest convs, once each in cuDNN and in our CUTLASS configurations, for Nsight Compute.

Usage (on the GPU machine):
  ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats \
      python3 scripts/ncu_conv_layers.py up1,up3 128x256p,256x128p

Every conv runs once as a warm-up, then once more between cudaProfilerStart/Stop, so that ncu profiles
one launch of each (cuDNN first, then the configurations in the order given). ncu locks the clocks to
base: its durations compare the kernels' work at equal clocks (docs/KERNEL_NOTES.md, fifth session).
"""

import sys

import torch
import torch.nn.functional as F

from pan2cli.vae.kernel.build import load_kernel
from pan2cli.vae.kernel.conv import conv_cutlass

ops = load_kernel()
# up1's 3x3x3 1024 -> 1024 on a chunk of 8 frames; up3's conv1 512 -> 256 on a pass of 2 (704x1248 decode)
layers = {"up1": ((1, 10, 90, 156, 1024), 1024), "up3": ((1, 4, 354, 624, 512), 256)}
for name in sys.argv[1].split(","):
    shape, c_out = layers[name]
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(c_out, shape[-1], 3, 3, 3, device="cuda") * 0.01).to(torch.bfloat16)
    w = w.contiguous(memory_format=torch.channels_last_3d)
    fns = [lambda: F.conv3d(x.permute(0, 4, 1, 2, 3), w, padding=(0, 0, 1))] + [
        (lambda c=c: conv_cutlass(ops, x, w, None, 1, c)) for c in sys.argv[2].split(",")
    ]
    for fn in fns:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in fns:
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
