"""Hybrid models through the engine (issue 18's H200 benchmark): random
weights at the Qwen3.5-35B-A3B shape (transformers' Qwen3_5MoeTextConfig
defaults: 40 layers, 3 of every 4 Gated DeltaNet, 256 experts, top 8), bf16.

    python tests/perf/bench_gpu_hybrid.py [--sections decode,prefill,turns,transformers,mtp]
        [--batches 1,8] [--tokens 64] [--prefill 8192,32768] [--cut-layers 8] [--smoke]

- decode: tok/s at each batch size; batch 1 against the roofline of the
  bytes a step reads (the weights outside the routed experts, 8 active
  experts a layer, the lm_head, every linear-attention layer's recurrent
  state read and written, the full-attention layers' KV) at the device copy
  rate measured in the same run.
- prefill: tokens/s of one prompt of each length, and the time its
  linear-attention and full-attention layers take (CUDA events around each
  layer's token mixer, in a separate timed pass).
- turns: time to first token of a conversation's second turn (8k-token
  first turn and its 64-token answer, then 200 new tokens), resumed from
  the state checkpoint the first turn left, against computing it again
  (--ctx-checkpoints 0), in the same run.
- transformers: batch-1 decode and an 8k prefill of transformers'
  Qwen3_5MoeForCausalLM against ours, both cut to --cut-layers layers (two
  full models do not fit one H200 at once).
- mtp: decode tok/s with --spec mtp (the checkpoint's MTP head, random
  here) and --spec ngram against no speculation, in the same run: a random head's drafts are
  all rejected, so this is what the head costs every step (its pass over
  the step's rows, the drafting rounds before the adaptive control stops
  them) where it does not pay; with a trained head the accepted drafts come
  on top.

--smoke runs a tiny model on the CPU in seconds (tests/test_perf_smoke.py).
Writes $OUT/bench_gpu_hybrid.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.loader import LoadedModel
from engine.models import ModelConfig, build_model
from engine.models.hybrid_layers import GatedAttention, GatedDeltaNet
from engine.models.moe import SparseMoE
from router.heap import freeze_long_lived
from tests.perf.bench_gpu_speculation import run_batch
from tests.perf.gpu_models import copy_bandwidth, make_engine

QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "num_experts": 256, "num_experts_per_tok": 8, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                        "partial_rotary_factor": 0.25},
}
TINY: dict[str, Any] = {
    **QWEN3_5_35B_A3B, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
}
ANSWER_TOKENS = 64
NEW_TURN_TOKENS = 200


@torch.inference_mode()
def hybrid_model(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype,
                 with_mtp: bool = False) -> LoadedModel:
    """Random weights; with_mtp: with an MTP head (mtp_num_hidden_layers 1)."""
    config = ModelConfig.from_hf_config({**cfg, "mtp_num_hidden_layers": 1} if with_mtp else cfg)
    model = build_model(config, device, dtype, with_mtp=with_mtp)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.zero_()  # zero-centred norms: scale 1 (the gated norm's weight 0 is fine too)
        elif name.endswith(("a_log", "dt_bias")):
            param.zero_()  # decay exp(-softplus(a)): about 0.5 a token
        else:
            param.normal_(0.0, 0.02, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    n_params = sum(param.numel() for param in model.parameters())
    return LoadedModel(config, model, n_params, n_params * dtype.itemsize)


def step_bytes(loaded: LoadedModel, context: int) -> int:
    """Bytes a batch-1 decode step reads at `context` tokens: the weights
    but the embedding (one row) and the routed experts (experts_per_token a
    layer), the recurrent state (read and written), the full-attention KV."""
    config, total = loaded.config, 0
    for name, param in loaded.model.named_parameters():
        if name.endswith(("gate_up_weight", "down_weight")) or "embed_tokens" in name:
            continue
        total += param.numel() * param.element_size()
    for module in loaded.model.modules():
        if isinstance(module, SparseMoE):
            per_expert = module.gate_up_weight[0].numel() + module.down_weight[0].numel()
            total += module.moe.experts_per_token * per_expert * module.gate_up_weight.element_size()
    dims = config.linear_attention
    assert dims is not None
    linear_layers = config.num_layers - config.num_attention_layers
    state = dims.num_value_heads * dims.key_head_dim * dims.value_head_dim * 4
    total += 2 * linear_layers * state
    total += config.kv_bytes_per_token(torch.bfloat16) * context
    return total


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def decode_rows(loaded: LoadedModel, args: argparse.Namespace, cuda: bool,
                copy_rate: float) -> list[dict[str, Any]]:
    max_batch = max(args.batches)
    prompt_len = 128
    core, events = make_engine(loaded, device="cuda" if cuda else "cpu",
                               dtype="bfloat16" if cuda else "float32",
                               max_concurrency=max_batch, max_batched_tokens=4096,
                               max_context=prompt_len + args.tokens + 16, ctx_checkpoints=0)
    vocab = loaded.config.vocab_size
    rows = []
    for batch in args.batches:
        prompts = prompts_of(batch, prompt_len, vocab, batch)
        run_batch(core, events, f"warm-{batch}", prompts, 8, cuda)
        prefill_s, _ = run_batch(core, events, f"prefill-{batch}", prompts, 1, cuda)
        seconds, _ = run_batch(core, events, f"decode-{batch}", prompts, args.tokens, cuda)
        decode_s = max(seconds - prefill_s, 1e-9)
        row: dict[str, Any] = {"section": "decode", "batch": batch,
                               "tok_s": batch * (args.tokens - 1) / decode_s,
                               "step_ms": 1000 * decode_s / (args.tokens - 1)}
        if cuda and batch == 1:
            nbytes = step_bytes(loaded, prompt_len + args.tokens // 2)
            roofline = copy_rate / nbytes
            row.update(step_gb=nbytes / 1e9, roofline_tok_s=roofline,
                       of_roofline=row["tok_s"] / roofline)
        print(json.dumps(row), flush=True)
        rows.append(row)
    del core, events
    gc.collect()
    return rows


def mtp_rows(cfg: dict[str, Any], args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    """Decode with and without --spec mtp on the same model (its head random)."""
    loaded = hybrid_model(cfg, torch.device("cuda" if cuda else "cpu"),
                          torch.bfloat16 if cuda else torch.float32, with_mtp=True)
    prompt_len, rows = 128, []
    # n-gram drafts on the same random prompts: what any drafter's rounds
    # cost where nothing is accepted, beside the head's own cost.
    # "mtp-head-only": the head runs after every step but never drafts (its
    # own cost, without any drafting round's).
    for variant in ("none", "ngram", "mtp-head-only", "mtp"):
        spec = variant.split("-")[0]
        core, events = make_engine(loaded, device="cuda" if cuda else "cpu",
                                   dtype="bfloat16" if cuda else "float32",
                                   max_concurrency=max(args.batches), max_batched_tokens=4096,
                                   max_context=prompt_len + args.tokens + 16, ctx_checkpoints=0,
                                   spec=spec, draft_tokens=3)
        if variant == "mtp-head-only":
            core.scheduler.drafter.propose_batch = lambda rows: [[] for _ in rows]  # type: ignore[union-attr]
        for batch in args.batches:
            prompts = prompts_of(batch, prompt_len, loaded.config.vocab_size, batch)
            run_batch(core, events, f"warm-{spec}-{batch}", prompts, 8, cuda)
            prefill_s, _ = run_batch(core, events, f"prefill-{spec}-{batch}", prompts, 1, cuda)
            stats = core._stats
            drafted, accepted = stats.draft_tokens_total, stats.draft_accepted_tokens_total
            seconds, _ = run_batch(core, events, f"decode-{spec}-{batch}", prompts, args.tokens,
                                   cuda)
            decode_s = max(seconds - prefill_s, 1e-9)
            row = {"section": "mtp", "spec": variant, "batch": batch,
                   "tok_s": batch * (args.tokens - 1) / decode_s,
                   "drafted": stats.draft_tokens_total - drafted,
                   "accepted": stats.draft_accepted_tokens_total - accepted}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del core, events
        gc.collect()
    for row in rows:
        if row["spec"] != "none":
            plain = next(r for r in rows if r["spec"] == "none" and r["batch"] == row["batch"])
            row["of_plain"] = row["tok_s"] / plain["tok_s"]
    del loaded
    gc.collect()
    return rows


class MixerTimer:
    """CUDA events around every token mixer's forward: linear vs full attention."""

    def __init__(self, model: torch.nn.Module, cuda: bool) -> None:
        self.cuda = cuda
        self.spans: dict[str, list[tuple[Any, Any]]] = {"linear": [], "full": []}
        self.handles = []
        for module in model.modules():
            if isinstance(module, (GatedDeltaNet, GatedAttention)):
                kind = "linear" if isinstance(module, GatedDeltaNet) else "full"
                self.handles.append(module.register_forward_pre_hook(self._start))
                self.handles.append(module.register_forward_hook(
                    lambda mod, inputs, output, kind=kind: self._stop(kind)))
        self._open: Any = None

    def _event(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module: torch.nn.Module, inputs: Any) -> None:
        self._open = self._event()

    def _stop(self, kind: str) -> None:
        self.spans[kind].append((self._open, self._event()))

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {kind: sum(a.elapsed_time(b) for a, b in spans) / 1e3
                    for kind, spans in self.spans.items()}
        return {kind: sum(b - a for a, b in spans) for kind, spans in self.spans.items()}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def prefill_rows(loaded: LoadedModel, args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    rows = []
    longest = max(args.prefill)
    core, events = make_engine(loaded, device="cuda" if cuda else "cpu",
                               dtype="bfloat16" if cuda else "float32", max_concurrency=1,
                               max_batched_tokens=min(8192, longest),
                               max_context=longest + 8, ctx_checkpoints=0)
    vocab = loaded.config.vocab_size
    run_batch(core, events, "warm-prefill", prompts_of(1, min(longest, 1024), vocab, 1), 1, cuda)
    for length in args.prefill:
        prompt = prompts_of(1, length, vocab, length)
        seconds, _ = run_batch(core, events, f"prefill-{length}", prompt, 1, cuda)
        timer = MixerTimer(loaded.model, cuda)
        run_batch(core, events, f"prefill-timed-{length}", prompt, 1, cuda)
        split = timer.seconds()
        timer.close()
        row = {"section": "prefill", "tokens": length, "seconds": seconds,
               "tok_s": length / seconds, "linear_attention_s": split["linear"],
               "full_attention_s": split["full"]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    del core, events
    gc.collect()
    return rows


def turn_rows(loaded: LoadedModel, args: argparse.Namespace, cuda: bool) -> list[dict[str, Any]]:
    vocab = loaded.config.vocab_size
    first = prompts_of(1, args.turn_tokens, vocab, 7)[0]
    rows = []
    for checkpoints in (4, 0):
        core, events = make_engine(loaded, device="cuda" if cuda else "cpu",
                                   dtype="bfloat16" if cuda else "float32", max_concurrency=4,
                                   max_batched_tokens=min(8192, 2 * args.turn_tokens),
                                   max_context=args.turn_tokens + 1024,
                                   ctx_checkpoints=checkpoints)
        _, (answer,) = run_batch(core, events, f"turn1-{checkpoints}", [first], ANSWER_TOKENS,
                                 cuda)
        second = first + answer + prompts_of(1, NEW_TURN_TOKENS, vocab, 8)[0]
        ttft, _ = run_batch(core, events, f"turn2-{checkpoints}", [second], 1, cuda)
        cached = core.scheduler.num_cached_tokens_total
        row = {"section": "turns", "ctx_checkpoints": checkpoints, "first_turn": len(first),
               "second_turn": len(second), "ttft_s": ttft, "cached_tokens": cached}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del core, events
        gc.collect()
    return rows


def transformers_rows(cfg: dict[str, Any], args: argparse.Namespace,
                      device: torch.device) -> list[dict[str, Any]]:
    """transformers and ours on the same cut shape, one after the other."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    freeze_long_lived(collect_first=True)  # this import makes as many objects as all the others
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cut = {**cfg, "num_hidden_layers": args.cut_layers}
    hf_keys = {k: v for k, v in cut.items() if k not in ("architectures", "model_type")}
    rows = []
    with torch.device(device):
        hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hf_keys)).to(dtype).eval()
    vocab = cut["vocab_size"]
    prompt = prompts_of(1, args.cut_prefill, vocab, 3)[0]
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        hf(ids[:, :64])  # warm
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = hf(ids, use_cache=True)
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - started
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        for _ in range(args.tokens):
            out = hf(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        decode_s = time.perf_counter() - started
    rows.append({"section": "transformers", "engine": "transformers", "layers": args.cut_layers,
                 "prefill_tokens": len(prompt), "prefill_tok_s": len(prompt) / prefill_s,
                 "decode_tok_s": args.tokens / decode_s})
    print(json.dumps(rows[-1]), flush=True)
    del hf, cache, out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    loaded = hybrid_model(cut, device, dtype)
    core, events = make_engine(loaded, device=device.type, dtype=str(dtype).removeprefix("torch."),
                               max_concurrency=1, max_batched_tokens=len(prompt),
                               max_context=len(prompt) + args.tokens + 16, ctx_checkpoints=0)
    run_batch(core, events, "warm", [prompt[:64]], 4, cuda)
    prefill_s, _ = run_batch(core, events, "prefill", [prompt], 1, cuda)
    seconds, _ = run_batch(core, events, "decode", [prompt], args.tokens + 1, cuda)
    rows.append({"section": "transformers", "engine": "roundhouse", "layers": args.cut_layers,
                 "prefill_tokens": len(prompt), "prefill_tok_s": len(prompt) / prefill_s,
                 "decode_tok_s": args.tokens / max(seconds - prefill_s, 1e-9)})
    print(json.dumps(rows[-1]), flush=True)
    del core, events, loaded
    gc.collect()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="decode,prefill,turns,transformers,mtp")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill", default="8192,32768")
    parser.add_argument("--turn-tokens", type=int, default=8192)
    parser.add_argument("--cut-layers", type=int, default=8)
    parser.add_argument("--cut-prefill", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="tiny, on the CPU, seconds")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    freeze_long_lived(collect_first=True)
    args.prefill = [int(n) for n in args.prefill.split(",")]
    sections = set(args.sections.split(","))
    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    cfg = TINY if args.smoke else QWEN3_5_35B_A3B
    if args.smoke:
        args.batches, args.tokens, args.prefill = [1, 2], 6, [40, 80]
        args.turn_tokens, args.cut_layers, args.cut_prefill = 48, 4, 40
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                               "device": torch.cuda.get_device_name() if cuda else "cpu",
                               "rows": []}
    copy_rate = copy_bandwidth(device) if cuda else 0.0
    results["copy_gb_s"] = copy_rate / 1e9
    print(f"device copy {results['copy_gb_s']:,.0f} GB/s (read + written)", flush=True)
    if sections & {"decode", "prefill", "turns"}:
        loaded = hybrid_model(cfg, device, torch.bfloat16 if cuda else torch.float32)
        print(f"model: {loaded.n_params / 1e9:.1f}B parameters", flush=True)
        if "decode" in sections:
            results["rows"] += decode_rows(loaded, args, cuda, copy_rate)
        if "prefill" in sections:
            results["rows"] += prefill_rows(loaded, args, cuda)
        if "turns" in sections:
            results["rows"] += turn_rows(loaded, args, cuda)
        del loaded
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "transformers" in sections:
        results["rows"] += transformers_rows(cfg, args, device)
    if "mtp" in sections:
        results["rows"] += mtp_rows(cfg, args, cuda)
    if not args.smoke:  # (the smoke run's figures mean nothing: nothing is kept)
        out = Path(os.environ.get("OUT", "."))
        (out / "bench_gpu_hybrid.json").write_text(json.dumps(results, indent=2))
    # Frozen objects outlive the exit's collection: triton's nanobind
    # bindings (imported with transformers' model) would report them as leaks.
    gc.unfreeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
