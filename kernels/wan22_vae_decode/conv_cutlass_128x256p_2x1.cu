// Tile configuration 128x256p-2x1 of the implicit-GEMM conv: persistent, cooperative (conv_cutlass_persistent.cuh),
// CTA tile 128 pixels x 256 output channels x 64 input channels, clusters of 2 x 1 CTAs (M x N) sharing
// their filter tiles by TMA multicast.
#include "conv_cutlass_persistent.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90
PAN2_DEFINE_PERSISTENT_CONV(conv_cutlass_128x256p_2x1, 128, 256, 2, 1)
#endif
