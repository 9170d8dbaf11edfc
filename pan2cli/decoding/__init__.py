"""`pan2 decode` as a library: latents files in, videos out (`files.decode_files`), each named as `-o` and `--format`
say (`outputs.plan_outputs`); and the one routine that decodes latents into a written video (`write.decode_and_write`),
which `pan2 generate` runs for each of its videos too."""
