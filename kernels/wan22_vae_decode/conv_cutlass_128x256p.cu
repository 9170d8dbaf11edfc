// Tile configuration 128x256p of the implicit-GEMM conv: persistent, cooperative (conv_cutlass_persistent.cuh),
// CTA tile 128 pixels x 256 output channels x 64 input channels, two MMA warp groups.
#include "conv_cutlass_persistent.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90
PAN2_DEFINE_PERSISTENT_CONV(conv_cutlass_128x256p, 128, 256, 1, 1)
#endif
