"""The SwiGLU kernel (kernels/activation.py) on the GPU against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.activation import silu_and_mul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("rows", "intermediate"), [(1, 8), (37, 768), (4096, 6144),
                                                    # A grouped MoE step at 8,192 tokens and
                                                    # top-8: more rows than a grid's y (65,535).
                                                    (65_600, 512)])
def test_matches_the_reference(rows: int, intermediate: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn((rows, 2 * intermediate), device="cuda", generator=generator)
    x = x.to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    # The kernel rounds silu(gate) to bf16 before the product, as transformers does.
    expected = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    got = silu_and_mul(x)
    # Within one bf16 step of it (expf against torch's sigmoid may differ in
    # float32's last bit and round apart), every row written.
    assert (got.float() - expected.float()).abs().le(expected.float().abs() * 2**-7 + 1e-6).all()
    assert torch.allclose(got.float(), reference.silu_and_mul(x.float()), atol=0.05, rtol=0.02)
