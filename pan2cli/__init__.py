"""pan2cli: run the PAN 2 world model and decode its Wan2.2 VAE latents to video."""

from pan2cli.version import __version__ as __version__  # re-exported: `pan2cli.__version__`


def __getattr__(name: str):
    # Lazy: `pan2 --version` and `pan2 decode` do not import the pipeline (torch and the pipeline are heavy).
    if name == "VideoGenerator":
        from pan2cli.pipeline import VideoGenerator

        return VideoGenerator
    if name == "RuntimeConfig":
        from pan2cli.config import RuntimeConfig

        return RuntimeConfig
    raise AttributeError(f"module 'pan2cli' has no attribute {name!r}")
