"""PAN 2's text encoder: the Qwen3.5 text model (`qwen3_5`, `gated_delta_rule`), its chat tokenizer (`tokenizer`),
the checkpoint reading (`checkpoint`) and the release's text recipe (`encoder`). Import the modules themselves."""
