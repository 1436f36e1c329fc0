"""kernels.norm (RMSNorm, fused residual add + RMSNorm) against kernels.reference.

The kernel rounds at the same steps as the reference; only the variance's
summation order differs, so outputs must be bitwise equal except for a tiny
fraction of elements, those at most 2 bf16 ulps off (1 ulp in the normalized
value can become 2 after the bf16 weight product), and close to a float64
reference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference

pytestmark = pytest.mark.gpu

HIDDEN = [576, 1024, 4096, 5120]
TOKENS = [1, 3, 256, 4096]
EPS = 1e-6


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns mapped to integers that step by one per ulp across zero."""
    bits = x.contiguous().view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_nearly_bitwise(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 2) -> None:
    """Equal to ref except a tiny fraction of elements, each a few ulps off."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) or NaN elements"
    ulps = (ordered_bits(out) - ordered_bits(ref)).abs()
    differing = int((ulps > 0).sum())
    assert differing <= 2 + 1e-3 * out.numel(), f"{differing} of {out.numel()} elements differ"
    assert int(ulps.max()) <= max_ulps, f"an element is {int(ulps.max())} ulps off"


def assert_close_to_float64(out: torch.Tensor, exact: torch.Tensor) -> None:
    error = (out.double() - exact).norm() / exact.norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def rms_norm_float64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def random_inputs(tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    # Rows of different scales: the norm must not depend on the magnitude.
    x = (x * torch.rand(tokens, 1, device="cuda", generator=generator).mul(8).add(0.1)).to(
        torch.bfloat16
    )
    residual = (torch.randn(tokens, hidden, device="cuda", generator=generator) * 2).to(
        torch.bfloat16
    )
    weight = (1 + 0.5 * torch.randn(hidden, device="cuda", generator=generator)).to(torch.bfloat16)
    return x, residual, weight


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm_matches_reference(tokens: int, hidden: int) -> None:
    from kernels.norm import rms_norm

    x, _, weight = random_inputs(tokens, hidden, seed=tokens * 7919 + hidden)
    x_before = x.clone()
    out = nan_like(x)
    result = rms_norm(x, weight, EPS, out=out)
    torch.cuda.synchronize()
    assert result is out
    assert torch.equal(x, x_before)
    assert_nearly_bitwise(out, reference.rms_norm(x, weight, EPS))
    assert_close_to_float64(out, rms_norm_float64(x, weight, EPS))


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_matches_reference_and_updates_residual(tokens: int, hidden: int) -> None:
    from kernels.norm import add_rms_norm

    x, residual, weight = random_inputs(tokens, hidden, seed=tokens * 104729 + hidden)
    x_before, residual_before = x.clone(), residual.clone()
    ref_out, ref_summed = reference.add_rms_norm(x_before, residual_before, weight, EPS)
    out = nan_like(x)
    result, new_residual = add_rms_norm(x, residual, weight, EPS, out=out)
    torch.cuda.synchronize()
    assert result is out and new_residual is residual
    assert torch.equal(x, x_before)
    # The new residual is the bf16 sum, rounded exactly as torch rounds it.
    assert torch.equal(residual, ref_summed)
    assert_nearly_bitwise(out, ref_out)
    assert_close_to_float64(out, rms_norm_float64(ref_summed, weight, EPS))


@pytest.mark.parametrize("hidden", [8, 264, 2056, 16384])
@pytest.mark.parametrize("tokens", [5, 1029])
def test_odd_and_extreme_widths(tokens: int, hidden: int) -> None:
    """Rows with a partial last vector per thread, the widest supported, and
    a partial last CTA of 4 warp rows (large batches)."""
    from kernels.norm import add_rms_norm, rms_norm

    x, residual, weight = random_inputs(tokens, hidden, seed=tokens + hidden)
    out = rms_norm(x, weight, EPS)
    torch.cuda.synchronize()
    assert_nearly_bitwise(out, reference.rms_norm(x, weight, EPS))
    ref_out, ref_summed = reference.add_rms_norm(x, residual.clone(), weight, EPS)
    out, summed = add_rms_norm(x, residual, weight, EPS)
    torch.cuda.synchronize()
    assert torch.equal(summed, ref_summed)
    assert_nearly_bitwise(out, ref_out)


def test_out_may_be_x() -> None:
    from kernels.norm import add_rms_norm, rms_norm

    x, residual, weight = random_inputs(33, 4096, seed=1)
    expected = reference.rms_norm(x, weight, EPS)
    rms_norm(x, weight, EPS, out=x)
    torch.cuda.synchronize()
    assert_nearly_bitwise(x, expected)

    x, residual, weight = random_inputs(33, 1024, seed=2)
    ref_out, ref_summed = reference.add_rms_norm(x, residual.clone(), weight, EPS)
    add_rms_norm(x, residual, weight, EPS, out=x)
    torch.cuda.synchronize()
    assert torch.equal(residual, ref_summed)
    assert_nearly_bitwise(x, ref_out)


def test_empty_batch() -> None:
    from kernels.norm import add_rms_norm, rms_norm

    x = torch.empty(0, 1024, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    assert rms_norm(x, weight, EPS).shape == (0, 1024)
    out, residual = add_rms_norm(x, x.clone(), weight, EPS)
    assert out.shape == residual.shape == (0, 1024)


@pytest.mark.parametrize("hidden", [1024, 5120])
def test_cuda_graph_replay(hidden: int) -> None:
    """Captured with preallocated outputs, replayed on new inputs."""
    from kernels.norm import add_rms_norm, rms_norm

    x, residual, weight = random_inputs(64, hidden, seed=3)
    normed, out = torch.empty_like(x), torch.empty_like(x)
    rms_norm(x, weight, EPS, out=normed)  # compile outside the capture
    add_rms_norm(normed, residual.clone(), weight, EPS, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, weight, EPS, out=normed)
        add_rms_norm(normed, residual, weight, EPS, out=out)
    for seed in (4, 5):
        new_x, new_residual, _ = random_inputs(64, hidden, seed=seed)
        x.copy_(new_x)
        residual.copy_(new_residual)
        normed.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_normed = reference.rms_norm(new_x, weight, EPS)
        assert_nearly_bitwise(normed, ref_normed)
        # Chain through the kernel's own first output so the ulp check stays local.
        ref_out, ref_summed = reference.add_rms_norm(normed, new_residual, weight, EPS)
        assert torch.equal(residual, ref_summed)
        assert_nearly_bitwise(out, ref_out)


def test_bad_inputs_raise() -> None:
    from kernels.norm import add_rms_norm, rms_norm

    bf16 = torch.bfloat16
    x = torch.randn(4, 1024, device="cuda", dtype=bf16)
    weight = torch.randn(1024, device="cuda", dtype=bf16)
    bad_calls = [
        lambda: rms_norm(x.float(), weight, EPS),
        lambda: rms_norm(x.cpu(), weight.cpu(), EPS),
        lambda: rms_norm(x[0], weight, EPS),
        lambda: rms_norm(torch.randn(1024, 4, device="cuda", dtype=bf16).t(), weight[:4], EPS),
        lambda: rms_norm(x[:, :1016], weight[:1016], EPS),  # not contiguous
        lambda: rms_norm(torch.randn(4, 1020, device="cuda", dtype=bf16), weight[:1020], EPS),
        lambda: rms_norm(torch.randn(2, 16392, device="cuda", dtype=bf16),
                         torch.randn(16392, device="cuda", dtype=bf16), EPS),
        lambda: rms_norm(x, weight[:512], EPS),
        lambda: rms_norm(x, weight.float(), EPS),
        lambda: rms_norm(x, weight, EPS, out=torch.empty(4, 512, device="cuda", dtype=bf16)),
        lambda: rms_norm(x, weight, EPS, out=torch.empty(4, 1024, device="cuda")),
        # Contiguous but 2 bytes off a 16-byte boundary.
        lambda: rms_norm(torch.randn(4 * 1024 + 1, device="cuda", dtype=bf16)[1:].view(4, 1024),
                         weight, EPS),
        lambda: add_rms_norm(x, x[:2].clone(), weight, EPS),
        lambda: add_rms_norm(x, x.clone().float(), weight, EPS),
        lambda: add_rms_norm(x, x.clone(), weight[:8], EPS),
    ]
    residual = x.clone()
    bad_calls.append(lambda: add_rms_norm(x, residual, weight, EPS, out=residual))
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
