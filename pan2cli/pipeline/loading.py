"""How a batch runs, decided before anything loads (`BatchRan`), and steps 1-3 of `VideoGenerator.generate_batch`: the
prompts encoded, the start images encoded, the transformer loaded.

`ModelStages` is a part of `VideoGenerator` (a base class, as `BatchStream` is for step 4), kept here because it is
one job of its own: the run-time options resolved (`runtime_with`) and checked, the memory plan made, the kernels
chosen; the text encoder read in the background while the tokenizer loads, then released once every prompt is
encoded; the VAE encoder for the start images, released after them; the transformer read in a background
thread meanwhile where the device holds both (`BackgroundLoad`), else after them, and prepared (its fused kernels
and fp8 attention chosen). It uses the generator's helpers (`_run_job`, `_load_seconds`, `_release`, ...) and the
batch's `BatchRan` (`self._ran`).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from pan2cli import distributed
from pan2cli.config import GenerationSettings, runtime_with
from pan2cli.pipeline.background import BackgroundLoad
from pan2cli.pipeline.jobs import JobState
from pan2cli.pipeline.memory import free_memory
from pan2cli.pipeline.run_checks import precision_source
from pan2cli.pipeline.sidecar import BatchRan, ran_precision
from pan2cli.presets import Preset
from pan2cli.scheduler import uses_guidance

# Room left beside the text encoder and the transformer for the text encoder's activations and the allocator.
OVERLAP_MARGIN_BYTES = 4 * 2**30


class ModelStages:
    """How a batch runs and steps 1-3 of `generate_batch` (module docstring); a base class of `VideoGenerator`, not
    used alone."""

    def _decide_batch(
        self, settings: list[GenerationSettings], preset: Preset | None, shared: bool
    ) -> tuple[BatchRan, dict]:
        """How a batch of `settings` runs (`BatchRan`), before anything loads, and the transformer's tensor shapes:
        the run-time options (`runtime_with`) checked here, the memory plan said in one line and its cap applied.

        Raises:
            InputError: the precision cannot run here, no plan fits the GPU (or the cap), or the host lacks the
                memory the plan page-locks.
        """
        from pan2cli.dit.checkpoint import resolve_pan2_checkpoint
        from pan2cli.pipeline.planning import apply_cap, make_plan

        config = runtime_with(preset, self.config)
        config.check_precision(self.device, given_by=precision_source(preset, self.config))
        shapes = resolve_pan2_checkpoint(self.components.folder("transformer")).shapes
        apply_cap(self.device, config.max_gpu_memory_gib)
        plan = make_plan(
            config, self.device, settings, transformer_shapes=shapes, text_folder=self.components.folder("text_encoder"),
            dit_config=self.dit_config, dtype=self.dtype, vae_dtype=self.vae_dtype,
        )  # fmt: skip
        if plan is not None:
            self.info(plan.line())
        world = distributed.world_size()
        ran = BatchRan(
            config=config,
            precision=ran_precision(config, self.dtype),
            dit_fused_kernels=self._fused_kernels_run(config),
            ranks_share_jobs=shared,
            # ranks split a decode by rows only when they share the job and sit on one machine
            decode_rows_split=config.decode_kernel_parallel
            and shared
            and distributed.env_local_world_size(world) == world,
            memory_plan=plan,
            clock_start=self.clock_start if self.clock_start is not None else time.perf_counter(),
            clock_from="batch start" if self.clock_start is None else "command start",
        )
        return ran, shapes

    def _fused_kernels_run(self, config) -> bool:
        """Whether the DiT's fused Triton kernels run in a batch of `config` (asked for, and they can: CUDA, Triton,
        a power-of-two head dim); a GPU that cannot run them says why in one line."""
        from pan2cli.dit.fusions import triton_available

        if not config.dit_fused_kernels or self.device.type != "cuda":
            return False  # on the CPU the reference ops are the path: nothing to say
        head_dim = self.dit_config.get("attention_head_dim", 128)
        reason = None
        if not triton_available():
            reason = "Triton is not installed"
        elif head_dim & (head_dim - 1):
            reason = f"head_dim {head_dim} is not a power of two"
        if reason:
            self.info(f"Using the PyTorch DiT ops: {reason}.")
        return reason is None

    def _start_text_read(self) -> BackgroundLoad:
        """The text encoder's tensors read to the device in the background (`read_text_tensors`)."""
        from pan2cli.text.checkpoint import read_text_tensors

        folder = self.components.folder("text_encoder")
        where = self._text_device()
        return BackgroundLoad(
            lambda tick: read_text_tensors(folder, where, on_tensor=tick),
            self.device,
            name="pan2-text-encoder-read",
        )

    def _text_device(self) -> torch.device:
        """Where the text model is read: the device, or host memory when the plan streams some of its layers."""
        plan = self._ran.memory_plan
        return torch.device("cpu") if plan is not None and plan.text_encoder.streamed else self.device

    def _encode_texts(
        self, states: list[JobState], transformer: BackgroundLoad | None, text_tensors: BackgroundLoad
    ) -> None:
        """1. Every prompt (and negative prompt, with guidance) encoded (`JobState.text`); the text encoder freed."""
        from pan2cli.text.checkpoint import load_text_model, load_tokenizer
        from pan2cli.text.encoder import PAN2TextEncoder

        tokenizer = load_tokenizer(self.components.folder("tokenizer"))  # while the text read runs
        text_model = load_text_model(
            self.components.folder("text_encoder"),
            dtype=self.dtype,
            device=self._text_device(),
            tensors=text_tensors.result(),
        )
        plan = self._ran.memory_plan
        if plan is not None and plan.text_encoder.streamed:  # some layers stream from host memory
            from pan2cli.pipeline.offload import LayerStreamer, stream_layers

            stream_layers(
                text_model, "layers", self.device, LayerStreamer(self.device, plan.text_encoder.streamed)
            )
        encoder = PAN2TextEncoder(tokenizer, text_model)
        text_model = None
        seconds = time.perf_counter() - text_tensors.started  # from the read's start: one stage
        self._load_seconds(states, "load_text_encoder", seconds)
        todo = [s for s in states if not s.failed]
        check = transformer.check if transformer is not None else (lambda: None)
        check()  # a transformer that cannot be read stops the batch now, not after every prompt is encoded

        def encode(prompt: str, what: str = "the prompt") -> torch.Tensor:
            features, cut = encoder.encode(prompt)
            if cut:  # the release keeps at most 1536 tokens after the chat template's user header
                short = prompt if len(prompt) <= 40 else prompt[:40] + "…"
                self.warn(
                    f"{what} {short!r} is {cut} tokens over the text encoder's limit of {encoder.max_length}; its last {cut} tokens were cut."
                )
            return features

        with self.progress("Encoding the prompts", len(todo), "prompts") as advance:
            for state in todo:
                settings = state.job.settings

                def work(state=state, settings=settings):
                    cond = encode(settings.prompt)
                    guided = uses_guidance(settings.guidance)
                    state.text = (
                        cond,
                        encode(settings.negative_prompt, "the negative prompt") if guided else None,
                    )

                self._run_job(state, "text_encoding", work)
                advance(1)
                check()
        encoder.release()
        encoder = None  # frees the model (the closures above share this variable, so no `del`)
        self._release()

    def _encode_images(self, states: list[JobState], transformer: BackgroundLoad | None) -> None:
        """2. Every start frame known before the denoising through the VAE encoder (`JobState.image_latent`): start
        images, and a round's when it continues a file (`pan2cli.pipeline.rounds`); the encoder then freed, unless a
        round starts later from one made in the batch."""
        todo = [s for s in states if not s.failed and self._starts_from_file(s.job)]
        if todo:
            if transformer is not None:
                transformer.check()
            self._decode_start_videos(todo)
            for state in todo:
                work = lambda state=state: self._encode_start(state, self._start_image(state.job), todo)  # noqa: E731
                self._run_job(state, "image_encoding", work)
        if any(s.job.chain is not None and s.job.chain.previous is not None for s in states):
            self._park_encoder()  # kept for the rounds that start later from one made in the batch
        elif self._encoder is not None:
            self._encoder = None  # frees the encoder
            self._release()

    def _start_transformer_load(self, shapes: dict, after: BackgroundLoad) -> BackgroundLoad | None:
        """The transformer's load (its tensors' `shapes`) started in the background where the device has room for it
        beside the text encoder, its reads from the end of `after`'s (the text encoder's); else None (it loads after
        the text encoder is freed), said in one line."""
        from pan2cli.dit.checkpoint import loaded_bytes

        config, plan = self._ran.config, self._ran.memory_plan
        if config.offload:
            self.info("Loading the transformer after the text encoder (--offload: one model at a time).")
            return None
        if plan is not None and (plan.transformer.streamed or plan.text_encoder.streamed):
            self.info(
                "Loading the transformer after the text encoder (the memory plan streams: one model at a time)."
            )
            return None
        dit_bytes = loaded_bytes(shapes, self.dtype, precision=config.precision)
        text_bytes = sum(
            p.stat().st_size for p in self.components.folder("text_encoder").glob("*.safetensors")
        )
        need = dit_bytes + text_bytes + OVERLAP_MARGIN_BYTES
        free, where = free_memory(self.device)
        if plan is not None and plan.cap_bytes is not None and free is not None and plan.cap_bytes < free:
            free, where = plan.cap_bytes, "--max-gpu-memory"
        if free is None or need > free:
            have = f"{free / 2**30:.1f} GiB free" if free is not None else "free memory unknown"
            self.info(
                f"Loading the transformer after the text encoder: both need {need / 2**30:.1f} GiB, {where} has {have}."
            )
            return None
        return BackgroundLoad(self._read_dit, self.device, name="pan2-transformer-load", after=after)

    def _read_dit(self, on_tensor: Callable[[], None] | None = None):
        """The transformer from its checkpoint, on the device but for the blocks the memory plan (or, on the CPU,
        `offload`) streams from host memory."""
        from pan2cli.dit.checkpoint import load_pan2_transformer
        from pan2cli.pipeline.offload import LayerStreamer, enable_block_offload

        config, plan = self._ran.config, self._ran.memory_plan
        folder = self.components.folder("transformer")
        layers = self.dit_config.get("num_layers", 44)
        if plan is not None:
            streamed = plan.transformer.streamed
        else:  # the CPU: the blocks are in host memory already; --offload streams them to the CPU all the same
            streamed = range(layers) if config.offload else ()
        # fp8: each block quantised on the GPU as it is read (the bf16 model is never whole there); a block that
        # streams goes to host memory as soon as it is read (`LayerStreamer.stage`).
        streamer = LayerStreamer(self.device, streamed) if streamed else None
        model = load_pan2_transformer(
            folder, dtype=self.dtype, device=self.device, precision=config.precision, on_tensor=on_tensor,
            on_block=streamer.stage if streamer is not None else None,
        )  # fmt: skip
        if streamer is not None:
            enable_block_offload(model, self.device, streamer=streamer).compact_resident()
        return model

    def _prepare_dit(self, model):
        """The loaded transformer's kernels set as the batch runs them (`BatchRan.dit_fused_kernels`) and its fp8
        attention chosen."""
        from pan2cli.dit.fusions import set_fused_kernels

        if (
            self._ran.config.precision == "fp8"
        ):  # the fp8 attention chosen once for the run (built now where it is ours)
            from pan2cli.dit.fp8_attention_choice import resolve_fp8_attention, use_fp8_attention

            head_dim = self.dit_config.get("attention_head_dim", 128)
            choice = resolve_fp8_attention(self._ran.config.fp8_attention, self.device, head_dim)
            use_fp8_attention(model, choice)
            if choice.fallback:
                self.info(f"fp8 attention: pan2's Triton kernel ({choice.reason}).")
        set_fused_kernels(model, self._ran.dit_fused_kernels)
        return model

    def _load_dit(self, states: list[JobState], transformer: BackgroundLoad | None, tensors: int):
        """3. The transformer (`tensors` of them), ready to sample (None, and its background read cancelled, when no
        job is left)."""
        todo = [s for s in states if not s.failed]
        if not todo:
            if transformer is not None:
                transformer.cancel()  # nothing left to sample
            return None
        start = time.perf_counter()
        with self.progress("Loading the transformer", tensors, "tensors") as advance:
            if transformer is not None:  # read in the background since the batch began
                transformer.wait(on_tick=advance)
                # taken: the load keeps no reference, so the model goes when the batch releases it
                model = transformer.take()
                overlapped = ["load_text_encoder", "text_encoding"]
                if any(s.job.settings.image is not None for s in states):
                    overlapped += ["load_vae_encoder", "image_encoding"]
                self._load_seconds(
                    todo, "load_transformer", transformer.seconds,
                    overlapped_with=overlapped, waited=time.perf_counter() - start,
                )  # fmt: skip
            else:
                model = self._read_dit(on_tensor=lambda: advance(1))
                self._load_seconds(todo, "load_transformer", time.perf_counter() - start)
        return self._prepare_dit(model)
