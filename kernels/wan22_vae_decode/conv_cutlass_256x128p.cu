// Tile configuration 256x128p of the implicit-GEMM conv: persistent, cooperative (conv_cutlass_persistent.cuh),
// CTA tile 256 pixels x 128 output channels x 64 input channels, two MMA warp groups of 128 rows each.
#include "conv_cutlass_persistent.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90
PAN2_DEFINE_PERSISTENT_CONV(conv_cutlass_256x128p, 256, 128, 1, 1)
#endif
