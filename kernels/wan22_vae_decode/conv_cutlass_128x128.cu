// Tile configuration 128x128 of the implicit-GEMM conv (conv_cutlass.cuh): CTA tile 128 pixels x 128 output
// channels x 64 input channels, cluster 1 x 1.
#include "conv_cutlass.cuh"

#if defined(PAN2_CUTLASS_CONV)
PAN2_DEFINE_CUTLASS_CONV(conv_cutlass_128x128, 128, 128, 1)
#endif
