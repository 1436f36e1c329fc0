"""A request without a seed samples from the server's --seed, else a fresh one."""

from __future__ import annotations

import pytest

from router.errors import InvalidRequest
from router.sampling import SamplingDefaults, SamplingRequest, build_params


def params(request: SamplingRequest, defaults: SamplingDefaults, **kw: object):  # type: ignore[no-untyped-def]
    return build_params(request, max_tokens=4, defaults=defaults, eos_token_ids=(2,), **kw)  # type: ignore[arg-type]


def test_every_request_gets_its_own_seed() -> None:
    configured = SamplingDefaults(seed=7)
    assert params(SamplingRequest(), configured).seed == 7
    assert params(SamplingRequest(seed=3), configured).seed == 3
    # -1 (the default): a fresh random seed each time, never the engine's shared stream.
    seeds = {params(SamplingRequest(), SamplingDefaults()).seed for _ in range(8)}
    assert None not in seeds and len(seeds) == 8


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    request = SamplingRequest(logit_bias={5: 1.0, 99: -1.0})
    assert params(request, SamplingDefaults(), n_vocab=100).logit_bias == {5: 1.0, 99: -1.0}
    with pytest.raises(InvalidRequest) as refused:
        params(request, SamplingDefaults(), n_vocab=50)
    assert refused.value.param == "logit_bias"
