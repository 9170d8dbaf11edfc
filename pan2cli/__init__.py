"""pan2cli: run the PAN 2 world model and decode its Wan2.2 VAE latents to video."""

__version__ = "0.1.0"
