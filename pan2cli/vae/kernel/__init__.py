"""The compiled decode path of the Wan2.2 VAE: the extension's build and ops, the kernel decoder, and its
fixed-order Triton convolution."""
