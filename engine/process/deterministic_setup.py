"""What batch-invariant mode (--deterministic) needs of the model, checked at
load before anything is sized: the options it cannot honour are refused by
EngineOptions already (speculation, vision, FP8 and packed weights asked
for); here, the model's own kinds.

The mode promises that a token's hidden state is the same bits whatever
shares its step, however its prompt was chunked and whether its prefix's
K/V came from a prefill or a decode step (docs/architecture.md). That holds
where each op computes a row with one order of its own: our dense kernels
(engine/execution/model_ops.py) and the reference a row at a time
(engine/execution/rowwise_ops.py).
"""

from __future__ import annotations

import logging

from engine.execution.quantized_weight import quantized_weights
from engine.loader import LoadedModel

log = logging.getLogger(__name__)

# The batch-invariant projection kernel reads K in 16-byte vectors of bf16;
# the norm kernels take rows up to this many elements.
_K_MULTIPLE = 8
_MAX_HIDDEN = 16384


def refuse_unsupported(loaded: LoadedModel, use_kernels: bool) -> None:
    """Raises ValueError naming why the mode cannot serve this model."""
    config = loaded.config
    name = config.architecture
    if config.moe is not None:
        raise ValueError(f"--deterministic: {name} is a mixture-of-experts model; its experts' "
                         "kernels group a step's tokens by expert (which tokens share an "
                         "expert changes the sums): dense models only")
    if config.has_recurrent_state:
        raise ValueError(f"--deterministic: {name} is a hybrid (recurrent) model; its linear "
                         "attention computes a prompt chunk in one pass and a decode token by "
                         "itself, in other orders: dense models only")
    if quantized_weights(loaded.model):
        raise ValueError(f"--deterministic: {name}'s projections are FP8 or packed GGUF "
                         "matrices, which have no batch-invariant kernel: serve its bf16 "
                         "weights")
    if use_kernels:
        widths = {"hidden size": config.hidden_size, "attention width": config.q_size,
                  "intermediate size": config.intermediate_size}
        odd = [f"{what} {value}" for what, value in widths.items() if value % _K_MULTIPLE]
        if odd or config.hidden_size > _MAX_HIDDEN:
            raise ValueError(f"--deterministic: {name}'s {', '.join(odd) or 'hidden size'} "
                             f"does not fit the batch-invariant kernels (multiples of "
                             f"{_K_MULTIPLE}, hidden size up to {_MAX_HIDDEN})")


def log_mode(use_kernels: bool) -> None:
    if use_kernels:
        log.info("batch-invariant mode (--deterministic): every token a decode row, "
                 "projections through the batch-invariant skinny kernel, attention with one "
                 "split; slower than the default (docs/performance.md)")
    else:
        log.info("batch-invariant mode (--deterministic): the torch reference one token row "
                 "at a time (slow: meant for tests and small models)")
