"""Runs one scheduled step on the model: builds the flat batch, runs the
forward pass over the paged KV cache, and samples the rows that need a token.

The runner owns the engine's device state (weights, KV tensors, the decode
workspace and CUDA graphs), so putting it to sleep and waking it are its job too.

On a GPU in bf16 the model runs our kernels (engine/model_ops.py) and decode
steps replay CUDA graphs (engine/cuda_graphs.py); steps with prompt chunks,
and decode batches above the largest captured size, run eagerly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.cuda_graphs import DecodeGraphs
from engine.device_state import (
    DroppedWeights,
    KVCache,
    KVPageStash,
    WeightsMode,
    WeightStash,
    device_bytes,
    release_device_memory,
)
from engine.loader import LoadedModel, load_model
from engine.model_ops import REFERENCE_OPS, CudaOps, ReferenceOps
from engine.models import CausalLM
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.step_inputs import DeviceInputs, StepInputs, build_step_inputs
from engine.token_mask import TokenMask


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
        self._model_mtime = os.path.getmtime(model_path)
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
        if os.path.getmtime(self.model_path) != self._model_mtime:
            raise RuntimeError(
                f"{self.model_path} changed while the engine slept; its kept KV pages belong "
                "to the old weights: unload the model and load it again"
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
        inputs = build_step_inputs(out, self.page_size)
        hidden = self._forward(inputs)
        if not inputs.sample_rows:
            return []
        if len(inputs.sample_rows) < inputs.num_tokens:
            rows = torch.tensor(inputs.sample_rows, dtype=torch.int64).to(self.device,
                                                                           non_blocking=True)
            hidden = hidden.index_select(0, rows)
        logits = self.model.compute_logits(hidden)
        return self.sampler.sample(logits, inputs.sample_seqs, mask)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.handles(inputs):
            return self.graphs.run(inputs)
        input_ids, positions, meta = self._inputs.metadata(inputs)
        return self.model.forward(input_ids, positions, meta, self.kv_caches)
