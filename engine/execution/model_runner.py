"""Runs one scheduled step on the model: builds the flat batch, runs the
forward pass over the paged KV cache, and samples the rows that need a token.

The runner owns the engine's device state (weights, KV tensors, the decode
workspace and CUDA graphs), so putting it to sleep and waking it are its job too.

On a GPU in bf16 the model runs our kernels (engine/execution/model_ops.py) and decode
steps replay CUDA graphs (engine/execution/cuda_graphs.py); steps with prompt chunks,
and decode batches above the largest captured size, run eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.execution.cuda_graphs import DecodeGraphs, context_bucket, context_buckets
from engine.execution.decode_lookahead import (
    LaunchedStep,
    inputs_key,
    next_decode_inputs,
    scheduled_key,
)
from engine.execution.device_state import (
    DroppedWeights,
    KVCache,
    KVPageStash,
    WeightFiles,
    WeightsMode,
    WeightStash,
    device_bytes,
    release_device_memory,
)
from engine.execution.model_ops import REFERENCE_OPS, CudaOps, ReferenceOps
from engine.execution.step_inputs import DeviceInputs, StepInputs, build_step_inputs
from engine.loader import LoadedModel, load_model
from engine.models import CausalLM
from engine.sampling.sampler import Sampler
from engine.sampling.token_mask import TokenMask
from engine.scheduling.scheduler import SchedulerOutput


@dataclass
class _Sleeping:
    kv: KVPageStash
    # None: the weights stayed where they were (the CPU device is host memory).
    weights: WeightStash | DroppedWeights | None


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        sampler: Sampler,
        use_kernels: bool = False,
        max_batch: int = 0,
        max_context: int = 0,
        cuda_graph: bool = False,
    ):
        """use_kernels: run our CUDA kernels (bf16 on a GPU); max_batch and
        max_context size their decode workspace and graphs. cuda_graph: capture
        decode graphs (needs use_kernels) — capture_graphs() does it, after the
        KV pool exists. num_pages 0 defers the KV pool to allocate_kv()."""
        self.model = loaded.model
        self.config = loaded.config
        # Where a wake after Sleep(weights="disk") reads the weights again.
        self.model_path = model_path
        # Checked before a disk wake reads the files again (WeightFiles).
        self._weight_files = WeightFiles.of(Path(model_path))
        self.device = device
        self.dtype = dtype
        self.num_pages = num_pages
        self.page_size = page_size
        self.sampler = sampler
        self.use_kernels = use_kernels
        self.max_batch = max_batch
        self.max_context = max_context
        self.cuda_graph = cuda_graph and use_kernels
        self._inputs = DeviceInputs(device)
        self.model.ops = self._make_ops()
        self.kv_caches = self._allocate_kv() if num_pages else []
        self.graphs: DecodeGraphs | None = None
        # A decode step launched ahead of the host (engine/execution/decode_lookahead.py).
        self._launched: LaunchedStep | None = None
        self._host_tokens: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self._host_turn = 0
        self._sleeping: _Sleeping | None = None

    def _make_ops(self) -> ReferenceOps:
        if not self.use_kernels:
            return REFERENCE_OPS
        return CudaOps(self.config, self.device, self.max_batch, self.max_context)

    def allocate_kv(self, num_pages: int) -> None:
        """Create the KV pool (after automatic sizing has chosen num_pages)."""
        self.num_pages = num_pages
        self.kv_caches = self._allocate_kv()

    def capture_graphs(self) -> float:
        """Capture the decode graphs if enabled; returns the seconds taken."""
        if not self.cuda_graph:
            return 0.0
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, max_batch=self.max_batch, max_context=self.max_context,
            page_size=self.page_size, device=self.device,
        )
        return self.graphs.capture()

    def _allocate_kv(self) -> list[KVCache]:
        shape = (self.num_pages, self.page_size, self.config.num_kv_heads, self.config.head_dim)
        dtype, device = self.dtype, self.device
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(self.config.num_layers)]

    # ---- sleep and wake --------------------------------------------------------

    @property
    def asleep(self) -> bool:
        return self._sleeping is not None

    def device_bytes(self) -> int:
        """Device memory this process holds (CUDA: reserved by torch; CPU: 0)."""
        return device_bytes(self.device)

    def sleep(self, weights: WeightsMode, keep_pages: Sequence[int]) -> int:
        """Give the device memory back. keep_pages (the prefix cache's pages)
        are copied to host memory and return on wake(); every other page's
        contents are lost, so nothing may be running. weights="host" keeps a
        host copy of the weights (on the CPU device they already are one);
        "disk" drops them and wake() reads the model file again.
        Returns the bytes of host memory taken for the copies."""
        if self._sleeping is not None:
            raise RuntimeError("the model runner is already asleep")
        pin = self.device.type == "cuda"
        self._launched = None
        if pin:
            torch.cuda.synchronize(self.device)  # nothing may still replay a graph
        if self.graphs is not None:
            # Graphs hold the addresses of what is about to be freed.
            self.graphs.release()
            self.graphs = None
        self.model.ops = REFERENCE_OPS  # drops the decode workspace
        kv = KVPageStash(self.kv_caches, keep_pages, pin=pin)
        self.kv_caches = []
        stash: WeightStash | DroppedWeights | None
        if weights == "disk":
            stash = DroppedWeights(self.model)
        elif self.device.type == "cpu":
            stash = None
        else:
            stash = WeightStash(self.model, pin=pin)
        self._sleeping = _Sleeping(kv, stash)
        release_device_memory(self.device)
        return kv.nbytes + (stash.nbytes if isinstance(stash, WeightStash) else 0)

    def wake(self) -> None:
        """Undo sleep(): weights and KV tensors back on the device, the kept
        pages back in their page ids. Raises on failure (a CUDA out-of-memory
        error, a model file changed meanwhile): the engine cannot go on."""
        sleeping = self._sleeping
        if sleeping is None:
            raise RuntimeError("the model runner is not asleep")
        if isinstance(sleeping.weights, DroppedWeights):
            sleeping.weights.put_back(self.model, self._reload_model())
        elif isinstance(sleeping.weights, WeightStash):
            sleeping.weights.put_back(self.model, self.device)
        self.kv_caches = self._allocate_kv()
        sleeping.kv.put_back(self.kv_caches)
        self.model.ops = self._make_ops()
        self._sleeping = None
        # The graphs captured before the sleep pointed at freed memory.
        self.capture_graphs()

    def _reload_model(self) -> CausalLM:
        # The kept KV pages (and the prefix-cache fingerprint) belong to the
        # weights loaded at start-up; a changed file must not be mixed in.
        # Never serve weights other than those validated at load, however
        # the file was rewritten: the engine ends and the router loads the
        # model afresh, as a new load, on its next request.
        changed = self._weight_files.changed()
        if changed:
            raise RuntimeError(
                f"{self.model_path} changed while the engine slept ({', '.join(changed[:3])}); "
                "its kept KV pages belong to the old weights: the model must be loaded again"
            )
        loaded = load_model(self.model_path, self.device, self.dtype)
        if loaded.config != self.config:
            raise RuntimeError(f"{self.model_path} now describes another model than it did at load")
        return loaded.model

    # ---- one step --------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, mask: TokenMask | None = None) -> list[int]:
        """Returns one sampled token per chunk whose `samples` is true, in order;
        mask (grammar rows) is indexed by those sampled rows."""
        launched, self._launched = self._launched, None
        if launched is not None and mask is None and launched.key == scheduled_key(out):
            # The step launched ahead is the one the scheduler wants.
            inputs, tokens, host, done = launched.inputs, launched.tokens, launched.host, \
                launched.done
        else:
            inputs = build_step_inputs(out, self.page_size)
            logits = self._logits(inputs)
            if logits is None:
                return []
            if self.graphs is None:
                return self.sampler.sample(logits, inputs.sample_seqs, mask)
            tokens = self.sampler.sample_on_device(logits, inputs.sample_seqs, mask)
            host, done = self._to_host(tokens)
        if self.graphs is not None:
            self._launch_next(inputs, tokens)
        done.synchronize()
        return host[: tokens.numel()].tolist()

    def _logits(self, inputs: StepInputs) -> torch.Tensor | None:
        """float32 logits of the rows that sample, or None if none does."""
        if self.graphs is not None and self.graphs.handles(inputs):
            # The graph computes every row's logits; decode rows all sample
            # but for the rare one-token prompt chunk.
            logits = self.graphs.run(inputs)
            if not inputs.sample_rows:
                return None
            if len(inputs.sample_rows) < inputs.num_tokens:
                logits = logits.index_select(0, self._rows(inputs.sample_rows))
            return logits
        hidden = self._forward(inputs)
        if not inputs.sample_rows:
            return None
        if len(inputs.sample_rows) < inputs.num_tokens:
            hidden = hidden.index_select(0, self._rows(inputs.sample_rows))
        return self.model.compute_logits(hidden)

    def _launch_next(self, inputs: StepInputs, tokens: torch.Tensor) -> None:
        """Put the following decode step on the GPU behind this one (see
        engine/execution/decode_lookahead.py), when every row can simply go on."""
        assert self.graphs is not None
        following = next_decode_inputs(inputs, self.page_size, self.max_context)
        if following is None or not self.graphs.handles(following):
            return
        logits = self.graphs.run(following, device_input_ids=tokens)
        next_tokens = self.sampler.sample_on_device(logits, following.sample_seqs, ahead=1)
        host, done = self._to_host(next_tokens)
        self._launched = LaunchedStep(inputs_key(following), following, next_tokens, host, done)

    def _to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Copy tokens into the next of two page-locked buffers (one may still
        be read for the step before) and mark when the copy is done."""
        self._host_turn ^= 1
        buffer = self._host_tokens[self._host_turn]
        if buffer.numel() < tokens.numel():
            buffer = torch.empty(max(tokens.numel(), 256), dtype=torch.int64, pin_memory=True)
            self._host_tokens[self._host_turn] = buffer
        buffer[: tokens.numel()].copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return buffer, done

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        bound = None
        if self.use_kernels and inputs.is_decode:
            # The decode kernel's split depends on this bound: an eager decode
            # step uses the bucket its graph would, so graphs on and off
            # compute the same numbers.
            bound = context_bucket(context_buckets(self.max_context), int(inputs.seq_lens.max()))
        input_ids, positions, meta = self._inputs.metadata(inputs, bound)
        return self.model.forward(input_ids, positions, meta, self.kv_caches)
