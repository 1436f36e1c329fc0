"""Torch reference implementations of the model ops.

Pure torch and device-agnostic: they run on the CPU path of the engine and are
the references that CUDA kernels are compared with. Shapes use T for tokens in
the flat batch, Hq/Hkv for query/key-value heads, D for the head size, P for
cache pages and S for the page size. Reductions (norm variance, softmax,
attention accumulation) run in float32 whatever the activation dtype.

The numerics follow Hugging Face transformers operation by operation (the
order of casts included) so that float32 models give the same greedy tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

SUPPORTED_ROPE_TYPES = ("linear", "llama3", "freq_factors")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim.

    x: [..., H] in the activation dtype; weight: [H] in the model dtype.
    Returns [..., H]. Normalizes in float32, casts back to x's dtype and only
    then scales by weight, as transformers does (it matters for bf16).
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual form used between sublayers.

    x, residual: [..., H], same dtype; weight: [H].
    Returns (rms_norm(x + residual), x + residual): the input of the next
    sublayer and the new residual stream.
    """
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """float32 [D/2] rotary inverse frequencies with the given scaling.

    scaling: None, {"rope_type": "linear", "factor"}, {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"} or {"rope_type": "freq_factors",
    "factors": [D/2 floats]} (llama.cpp's rope_freqs tensor: each frequency is
    divided by its factor; GGUF conversions store llama3 scaling this way).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(
                f"rope freq factors have {factors.numel()} entries, expected {inv_freq.numel()}"
            )
        return inv_freq / factors
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
    )


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept,
    # and the band between is blended linearly in 1/wavelength.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def build_rope_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The cos/sin table for positions 0..max_positions-1.

    Returns [max_positions, D]: cos of the D/2 frequencies in the first half,
    sin in the second. Angles are computed in float32 exactly as transformers
    does (position * inv_freq) and rounded to dtype once, so pass the model
    dtype: apply_rope then multiplies in the activation dtype as HF does.
    """
    inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device=device, dtype=dtype)


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the NeoX / rotate_half convention (transformers').

    positions: int64 [T]; q: [T, Hq, D]; k: [T, Hkv, D]; cos_sin_cache from
    build_rope_cache, in q's dtype. Returns new rotated (q, k), same shapes.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same products and sums as HF's x * cos + rotate_half(x) * sin, so the
    # result is bitwise equal to it, in low precision dtypes too.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused gate/up projection.

    x: [..., 2 * I] with the gate in the first half. Returns [..., I].
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# float8 e4m3 (an fp8 KV cache): its largest finite magnitude.
FP8_E4M3_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3(x / scale): float32 division, saturated at +-448, rounded to
    nearest even (what the cache-writing kernels store)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of an e4m3 tensor times its scale."""
    return x.float() * scale


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store the new tokens' keys and values in the paged cache, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [P, S, Hkv, D], contiguous, of k/v's
    dtype, or float8_e4m3fn (an fp8 cache: quantize_fp8 with k_scale,
    v_scale); slot_mapping: int64 [T], slot = page * S + offset, distinct;
    a slot of -1 writes nothing, as in our kernels (graph padding rows, an
    MTP head's rows with no next token).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if k_cache.dtype == torch.float8_e4m3fn:
        # Moved as bytes: torch has no float8 index_copy_ on the CPU.
        k = quantize_fp8(k, k_scale).view(torch.uint8)
        v = quantize_fp8(v, v_scale).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc_host: Sequence[int],
    seq_lens_host: Sequence[int],
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a flat batch over a paged KV cache.

    q: [T, Hq, D], Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv)); k_cache, v_cache: [P, S, Hkv, D]; block_tables: int32
    [B, max_pages]. Sequence b owns rows query_start_loc_host[b]:[b + 1];
    its q_len new tokens are the last q_len of its seq_lens_host[b] cached
    tokens, so row i sees cached tokens 0 .. seq_len - q_len + i. Decode rows
    (q_len 1) and prefill chunks over a cached prefix mix freely. The K/V of
    the new tokens must already be in the cache (write_kv_cache first).
    Returns [T, Hq, D] in q's dtype; scores, softmax and sums in float32.
    An fp8 cache (float8_e4m3fn) is read as its values times k_scale / v_scale.
    """
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens_host):
        start, end = query_start_loc_host[b], query_start_loc_host[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        pages = block_tables[b, : -(-seq_len // page_size)]
        keys = _gather_pages(k_cache, pages, seq_len, k_scale)
        values = _gather_pages(v_cache, pages, seq_len, v_scale)
        queries = q[start:end].transpose(0, 1).float()
        mask, is_causal = _causal_mask(q_len, seq_len, q.device)
        # NOTE: a leading batch dimension lets torch pick its fused CPU
        # attention kernel; 3-D inputs fall back to the math path (3x slower).
        attended = F.scaled_dot_product_attention(
            queries[None], keys[None], values[None],
            attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True,
        )[0]
        out[start:end] = attended.transpose(0, 1).to(q.dtype)
    return out


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, seq_len: int,
                  fp8_scale: float) -> torch.Tensor:
    """[seq_len, Hkv, D] rows of the pages in order -> float32 [Hkv, seq_len, D]."""
    rows = cache.index_select(0, pages).flatten(0, 1)[:seq_len]
    if cache.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(rows, fp8_scale).transpose(0, 1)
    return rows.transpose(0, 1).float()


def _causal_mask(
    q_len: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    # SDPA's is_causal aligns the mask top-left, which is only right when the
    # queries cover the whole sequence; a chunk over a cached prefix needs the
    # bottom-right alignment spelled out. A single query sees everything.
    if q_len == 1:
        return None, False
    if q_len == seq_len:
        return None, True
    offset = seq_len - q_len
    query_pos = torch.arange(offset, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    return key_pos <= query_pos, False


# ---------------------------------------------------------------------------
# Sampling: the semantics kernels/sampling.py's sample_tokens implements.
#
# Per row, with z = logits / temperature (float32) and p = softmax(z):
#   top-k (top_k > 0 and < V): keep z >= the k-th largest z;
#   top-p (top_p < 1):         keep z when the mass of the tokens strictly more likely
#                              than it, sum(p[z' > z]), is < top_p;
#   min-p (min_p > 0):         keep exp(z - max z) >= min_p (p >= min_p * max p);
# the tokens equal to the maximum always survive and -inf never does. These are value
# thresholds: for distinct values they are exactly engine/sampling/sampler.py's rule over the
# sorted order (rank < k; mass before the rank < top_p; p >= min_p * p[0]). They differ
# only at exact ties straddling a cut, where a value threshold keeps the whole tie group
# (so top-k can keep more than k tokens) while the sorted order cut it somewhere inside.
# Rows with temperature <= 0 are greedy: the one survivor is torch.argmax's token.
# ---------------------------------------------------------------------------


def _scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] logits / temperature; greedy rows (temperature <= 0) divided by 1."""
    greedy = ~(temperature > 0)
    safe = torch.where(greedy, torch.ones_like(temperature), temperature)
    return logits / safe.unsqueeze(1)


def sampling_survivors(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """bool [N, V], True where a token may be drawn, in vocabulary order.

    logits: float32 [N, V] (-inf allowed, at least one finite value per row);
    temperature: float32 [N]; top_k: int32 [N] (<= 0: off); top_p: float32 [N]
    (>= 1: off); min_p: float32 [N] (<= 0: off). Semantics in the comment above.
    """
    vocab = logits.shape[-1]
    scaled = _scaled_logits(logits, temperature)
    top = scaled.max(dim=-1, keepdim=True).values
    ordered, order = scaled.sort(dim=-1, descending=True)
    keep = scaled > -math.inf

    k = top_k.long()
    use_k = (k > 0) & (k < vocab)
    kth = ordered.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
    keep &= ~use_k.unsqueeze(1) | (scaled >= kth)

    # Mass strictly above each value: the exclusive cumulative mass at the first
    # position of the value's tie group in the sorted row.
    probs = ordered.softmax(dim=-1)
    exclusive = torch.zeros_like(probs)
    exclusive[:, 1:] = torch.cumsum(probs, dim=-1)[:, :-1]
    positions = torch.arange(vocab, device=logits.device).expand_as(ordered)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group_start = torch.where(starts, positions, 0).cummax(dim=-1).values
    mass_above = torch.empty_like(probs).scatter_(1, order, exclusive.gather(1, group_start))
    keep &= (top_p >= 1).unsqueeze(1) | (mass_above < top_p.unsqueeze(1))

    keep &= torch.exp(scaled - top) >= min_p.unsqueeze(1)
    keep |= scaled == top

    argmax = torch.zeros_like(keep).scatter_(1, logits.argmax(dim=-1, keepdim=True), True)
    return torch.where((temperature > 0).unsqueeze(1), keep, argmax)


def sampling_probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """float32 [N, V]: softmax(logits / temperature) restricted to the survivors and
    renormalized (one-hot at the argmax for greedy rows). Arguments as sampling_survivors."""
    keep = sampling_survivors(logits, temperature, top_k, top_p, min_p)
    probs = _scaled_logits(logits, temperature).softmax(dim=-1).masked_fill(~keep, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # (hi, lo) 32-bit halves of a * b for a 32-bit constant a and int64 tensor b in
    # [0, 2^32), without overflowing int64: split b into 16-bit halves.
    low = a * (b & 0xFFFF)
    high = a * (b >> 16)
    middle = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (middle >> 32), middle & _MASK32


def _philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-10 (Salmon et al., SC'11) on int64 tensors holding 32-bit words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_W0) & _MASK32
        k1 = (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def sampling_gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [N, V]: the Gumbel noise sample_tokens adds to token i of row n.

    seeds, offsets: int64 [N]. Token i uses word (i % 4) of Philox-4x32-10 with key
    (seed mod 2^32, seed >> 32) and counter (i // 4, 0, offset mod 2^32, offset >> 32);
    u = (r + 1/2) / 2^32 and G = -log(-log(u)), with -log(u) taken as -log1p(-(1 - u))
    when u >= 1/2. Equal to the kernel's noise up to the last bits of log/log1p, which
    differ between libraries; draws agree except at near-ties.
    """
    groups = -(-vocab // 4)
    seed = seeds.long().unsqueeze(1)
    offset = offsets.long().unsqueeze(1)
    c0 = torch.arange(groups, device=seeds.device).unsqueeze(0).expand(seeds.shape[0], groups)
    words = _philox4x32_10(
        (c0, torch.zeros_like(c0), (offset & _MASK32).expand_as(c0),
         ((offset >> 32) & _MASK32).expand_as(c0)),
        (seed & _MASK32, (seed >> 32) & _MASK32),
    )
    r = torch.stack(words, dim=-1).flatten(1)[:, :vocab]
    lower = r < 2**31
    # float(r) * 2^-32 is exact, so the one rounding of the addition is the kernel's fma.
    u = torch.where(lower, r, r ^ _MASK32).float() * 2.0**-32 + 2.0**-33
    exponential = torch.where(lower, -torch.log(u), -torch.log1p(-u))
    return -torch.log(exponential)


def sample_tokens_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """int64 [N]: the tokens sample_tokens draws (the Gumbel-max over the survivors of
    z + sampling_gumbel_noise; argmax for greedy rows). Arguments as sampling_survivors,
    seeds and offsets int64 [N]. Memory: a few [N, V] int64 tensors."""
    keep = sampling_survivors(logits, temperature, top_k, top_p, min_p)
    noise = sampling_gumbel_noise(seeds, offsets, logits.shape[-1])
    scores = (_scaled_logits(logits, temperature) + noise).masked_fill(~keep, -math.inf)
    return torch.where(temperature > 0, scores.argmax(dim=-1), logits.argmax(dim=-1))
