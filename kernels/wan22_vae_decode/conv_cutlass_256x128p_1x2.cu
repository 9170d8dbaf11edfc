// Tile configuration 256x128p-1x2 of the implicit-GEMM conv: persistent, cooperative (conv_cutlass_persistent.cuh),
// CTA tile 256 pixels x 128 output channels x 64 input channels, clusters of 1 x 2 CTAs (M x N) sharing
// their activation (im2col) tiles by TMA multicast.
#include "conv_cutlass_persistent.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90
PAN2_DEFINE_PERSISTENT_CONV(conv_cutlass_256x128p_1x2, 256, 128, 1, 2)
#endif
