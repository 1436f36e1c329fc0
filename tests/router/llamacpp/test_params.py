"""/completion's sampling fields: neutral values accepted, the rest refused,
the sampler chain read as llama.cpp reads it."""

from __future__ import annotations

import msgspec
import pytest

from router.errors import RouterError
from router.http.errors import api_error
from router.llamacpp.params import DEFAULT_SAMPLERS, completion_settings, sampler_chain
from router.llamacpp.schemas import CompletionRequest


def request(**fields: object) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **fields}, CompletionRequest)


def test_llamacpp_defaults_are_neutral() -> None:
    settings = completion_settings(request())
    assert settings.n_predict == -1 and settings.chain == DEFAULT_SAMPLERS
    sampling = settings.sampling
    assert sampling.temperature is None and sampling.top_k is None and sampling.seed is None
    assert sampling.repetition_penalty == 1.0 and not sampling.report_progress


def test_what_a_request_sets() -> None:
    settings = completion_settings(request(
        n_predict=7, temperature=-1, top_p=1.5, seed=-1, stop="END", repeat_penalty=1.1,
        frequency_penalty=0.5, stream=True, return_progress=True))
    sampling = settings.sampling
    assert settings.n_predict == 7
    assert sampling.temperature == 0.0  # negative: greedy, as in llama.cpp
    assert sampling.top_p == 1.0 and sampling.seed is None and sampling.stop == ("END",)
    assert sampling.repetition_penalty == 1.1 and sampling.frequency_penalty == 0.5
    assert sampling.report_progress
    assert completion_settings(request(max_tokens=3)).n_predict == 3
    assert completion_settings(request(n_predict=-5)).n_predict == -1
    # repeat_last_n 0 turns the penalties off.
    off = completion_settings(request(repeat_penalty=1.3, repeat_last_n=0)).sampling
    assert off.repetition_penalty == 1.0


def test_the_penalty_window_is_llama_cpps() -> None:
    assert completion_settings(request(repeat_penalty=1.1)).sampling.penalty_last_n == 64
    assert completion_settings(request(repeat_penalty=1.1, repeat_last_n=16)).sampling.penalty_last_n == 16
    whole = completion_settings(request(repeat_penalty=1.1, repeat_last_n=-1)).sampling.penalty_last_n
    assert whole >= 1 << 30
    with pytest.raises(RouterError):
        completion_settings(request(repeat_last_n=-2))


@pytest.mark.parametrize("fields", [
    {"mirostat_tau": 9.0}, {"dry_base": 3.0, "dry_sequence_breakers": ["x"]},
    {"xtc_threshold": 0.3}, {"dynatemp_exponent": 2.0}, {"min_keep": 1},
    {"logit_bias": {"15043": 0}}, {"lora": [{"id": 0, "scale": 0}]}, {"n_cmpl": 1},
    {"repeat_last_n": 64}, {"repeat_last_n": -1, "repeat_penalty": 1.2},
])
def test_settings_that_change_nothing_are_accepted(fields: dict[str, object]) -> None:
    completion_settings(request(**fields))


@pytest.mark.parametrize(("fields", "field"), [
    ({"mirostat": 1}, "mirostat"), ({"dry_multiplier": 0.5}, "dry_multiplier"),
    ({"dry_multiplier": 0.5, "dry_base": 0.5}, "dry_multiplier"),
    ({"xtc_probability": 0.5, "xtc_threshold": 0.2}, "xtc_probability"),
    ({"dynatemp_range": 0.5, "dynatemp_exponent": 2}, "dynatemp_range"),
    ({"logit_bias": [["Hello", 1.0]]}, "logit_bias"), ({"min_keep": 5}, "min_keep"),
    ({"n_cmpl": 2}, "n_cmpl"), ({"n": 3}, "n"), ({"grammar_lazy": True}, "grammar_lazy"),
    ({"adaptive_target": 0.5}, "adaptive_target"),
])
def test_settings_we_cannot_honour_are_refused(fields: dict[str, object], field: str) -> None:
    with pytest.raises(RouterError) as refused:
        completion_settings(request(**fields))
    assert api_error(refused.value).status == 400 and refused.value.code == f"{field}_not_supported"


def test_sampler_chain() -> None:
    assert sampler_chain("edskypmxt") == DEFAULT_SAMPLERS
    assert sampler_chain(["top_k", "nucleus", "temp"]) == ("top_k", "top_p", "temperature")
    left_out = completion_settings(request(samplers=["top_k", "temperature"], top_p=0.5,
                                           min_p=0.2, temperature=0.7)).sampling
    assert left_out.top_p == 1.0 and left_out.min_p == 0.0 and left_out.temperature == 0.7
    # Without a temperature sampler llama.cpp draws at 1.0.
    assert completion_settings(request(samplers="kp", temperature=0.2)).sampling.temperature == 1.0
    for chain, code in ((["temperature", "top_k"], "samplers_not_supported"),
                        (["top_k", "top_k"], "samplers_not_supported"),
                        (["warp"], "invalid_value"), ("kz", "invalid_value")):
        with pytest.raises(RouterError) as refused:
            sampler_chain(chain)
        assert refused.value.code == code


def test_logit_bias_takes_effect() -> None:
    for value in ({"15043": False, "7": 2.5, "9": 0}, [[15043, False], [7, 2.5], [9, 0]]):
        biases = completion_settings(request(logit_bias=value)).sampling.logit_bias
        assert biases == {15043: float("-inf"), 7: 2.5}
    with pytest.raises(RouterError) as refused:
        completion_settings(request(logit_bias=[[7, "up"]]))
    assert refused.value.param == "logit_bias"
