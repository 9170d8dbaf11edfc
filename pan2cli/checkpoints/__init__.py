"""Reading checkpoints, once for the VAE, the DiT, the text encoder and latents files.

`files` tensor files (safetensors, torch pickles) and their errors; `sharded` where a component's tensors
are (an index and its shards, locally or through a hub view); `keys` the strict key check; `json_files`
JSON objects (configs, indexes); `hub` Hugging Face downloads and their errors. Import the modules
themselves: this package imports nothing, so that torch-free callers stay torch-free.
"""
