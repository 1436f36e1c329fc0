"""--spec mtp: the checkpoint's MTP head drafts, on the CPU in float32.

The tiny hybrid checkpoints of test_hybrid_models.py get a random MTP head
(mtp.* tensors; the decoder layer's names are transformers' own, from one of
its full-attention layers). transformers has no MTP implementation, so the
reference here assembles the head from transformers' parts exactly as the
published checkpoints are run (engine/models/mtp_head.py): the target's
final hidden states from transformers' model, its embedding, RMSNorm and
decoder-layer modules, a causal mask and the model's RoPE. Every draft the
engine proposes, at every step of every request (after prompt chunks, decode
steps and verify steps that kept or cut drafts), must be the reference's
draft for the same tokens, computed from scratch; and the output stays
transformers' greedy output.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import protocol as p
from engine.loader import load_model
from engine.sampling.drafter import DraftRow
from engine.sampling.mtp_drafter import MTPDrafter
from tests.engine.test_hybrid_models import _hf_model
from tests.engine.test_hybrid_serving import greedy, hf_greedy, make_engine, prompt, run_all
from tests.support.fixtures import QWEN3_TOKENIZER_FILES, qwen3_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The full-attention layer each family's MTP layer is built like (its MLP
# kind: routed experts for Qwen3-Next's layer 3 and Qwen3.5-MoE, dense for Qwen3.5).
_MTP_LIKE_LAYER = {"qwen3_next": 3, "qwen3_5": 2, "qwen3_5_moe": 1}
_MTP_CONFIG_KEY = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers",
                   "qwen3_5_moe": "mtp_num_hidden_layers"}


class ReferenceHead:
    """The MTP head from transformers' modules, its weights random."""

    def __init__(self, hf: torch.nn.Module, family: str) -> None:
        torch.manual_seed(7)
        model = hf.model
        config = hf.config
        hidden = config.hidden_size
        index = _MTP_LIKE_LAYER[family]
        assert config.layer_types[index] == "full_attention"
        self.hf = hf
        self.index = index
        # The head's layer: a copy of that layer (its weights are random already).
        self.layer = copy.deepcopy(model.layers[index]).eval()
        norm = type(model.norm)
        self.embedding_norm = norm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = norm(hidden, eps=config.rms_norm_eps)
        self.norm = norm(hidden, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape) * 0.1)
            for module in (self.embedding_norm, self.hidden_norm, self.norm):
                module.weight.copy_(torch.randn(hidden) * 0.2)

    def tensors(self, saved: Path) -> dict[str, torch.Tensor]:
        """The head under the checkpoints' names; its layer's as transformers
        saved the layer it copies (in saved, the model's safetensors)."""
        prefix = f"model.layers.{self.index}."
        with safe_open(saved, "pt") as handle:
            tensors = {"mtp.layers.0." + name.removeprefix(prefix): handle.get_tensor(name)
                       for name in handle.keys() if name.startswith(prefix)}
        tensors.update({
            "mtp.fc.weight": self.fc.weight.clone(),
            "mtp.pre_fc_norm_embedding.weight": self.embedding_norm.weight.clone(),
            "mtp.pre_fc_norm_hidden.weight": self.hidden_norm.weight.clone(),
            "mtp.norm.weight": self.norm.weight.clone(),
        })
        return {name: value.contiguous() for name, value in tensors.items()}

    @torch.inference_mode()
    def draft(self, tokens: list[int], count: int) -> list[int]:
        """The head's greedy draft after tokens (all known), from scratch:
        rows 0..n-2 feed (h_i, t_{i+1}), then each guess feeds the row
        after with the head's own output."""
        model = self.hf.model
        target = model(torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
        rows = [self._input(target[i], tokens[i + 1]) for i in range(len(tokens) - 1)]
        out: list[int] = []
        for _ in range(count):
            outputs = self._layer(torch.stack(rows))
            guess = int(self.hf.lm_head(outputs[-1]).argmax())
            out.append(guess)
            rows.append(self._input(outputs[-1], guess))
        return out

    def _input(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        embedded = self.hf.model.embed_tokens(torch.tensor(token))
        return self.fc(torch.cat([self.embedding_norm(embedded), self.hidden_norm(hidden)]))

    def _layer(self, rows: torch.Tensor) -> torch.Tensor:
        count = rows.shape[0]
        x = rows[None]
        positions = torch.arange(count)[None]
        embeddings = self.hf.model.rotary_emb(x, positions)
        mask = torch.full((count, count), float("-inf")).triu(1)[None, None]
        out = self.layer(x, position_embeddings=embeddings, attention_mask=mask,
                         position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out[0])


@pytest.fixture(scope="module", params=list(_MTP_LIKE_LAYER))
def with_head(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, torch.nn.Module, ReferenceHead]:
    """(checkpoint directory with an MTP head, transformers' model, the reference head)."""
    family = request.param
    hf = _hf_model(family)
    head = ReferenceHead(hf, family)
    directory = tmp_path_factory.mktemp(f"{family}-mtp")
    hf.save_pretrained(directory, safe_serialization=True)
    save_file(head.tensors(directory / "model.safetensors"), directory / "mtp.safetensors")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config[_MTP_CONFIG_KEY[family]] = 1
    config_path.write_text(json.dumps(config))
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copyfile(qwen3_tokenizer() / name, directory / name)
    return directory, hf, head


def _recording(drafter: MTPDrafter) -> list[tuple[list[int], list[int]]]:
    """Every (tokens, draft) the drafter proposes from now on."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose_batch

    def spy(rows: list[DraftRow]) -> list[list[int]]:
        drafts = propose(rows)
        seen.extend((list(row.token_ids), draft) for row, draft in zip(rows, drafts, strict=True))
        return drafts

    drafter.propose_batch = spy  # type: ignore[method-assign]
    return seen


def test_every_draft_is_the_heads_and_the_output_is_plain_decodings(with_head) -> None:
    directory, hf, head = with_head
    prompts = {"long": prompt(90, 37), "short": prompt(91, 11), "mid": prompt(92, 20)}
    params = greedy(14)
    core, events = make_engine(directory, spec="mtp", draft_tokens=3)
    drafter = core.scheduler.drafter
    assert isinstance(drafter, MTPDrafter) and core.runner.mtp is drafter
    seen = _recording(drafter)
    got = run_all(core, events, {rid: (tokens, params) for rid, tokens in prompts.items()})
    for rid, tokens in prompts.items():
        assert got[rid].tokens == hf_greedy(hf, tokens, 14), rid
    drafted = [(tokens, draft) for tokens, draft in seen if draft]
    assert len(drafted) >= 6, seen
    for tokens, draft in drafted:
        assert draft == head.draft(tokens, len(draft)), len(tokens)


def test_drafts_after_verify_steps_are_the_heads(with_head) -> None:
    """A head that guesses right half of the time: drafts kept whole and cut
    short, and every later draft still the reference's from scratch."""
    directory, hf, head = with_head
    tokens = prompt(93, 18)
    expected = hf_greedy(hf, tokens, 16)
    core, events = make_engine(directory, spec="mtp", draft_tokens=3)
    drafter = core.scheduler.drafter
    assert isinstance(drafter, MTPDrafter)
    seen = _recording(drafter)
    # The head's first guess replaced by the target's own continuation on
    # every other call: steps that accept drafts, then the head's K/V after them.
    propose = drafter.propose_batch
    calls = [0]
    full = tokens + expected

    def oracle(rows: list[DraftRow]) -> list[list[int]]:
        drafts = propose(rows)
        calls[0] += 1
        if calls[0] % 2:
            return drafts
        return [full[len(row.token_ids): len(row.token_ids) + len(draft)] if draft else draft
                for row, draft in zip(rows, drafts, strict=True)]

    drafter.propose_batch = oracle  # type: ignore[method-assign]
    got = run_all(core, events, {"r": (tokens, greedy(16))})["r"]
    assert got.tokens == expected
    assert core._stats.draft_accepted_tokens_total >= 2
    checked = [(t, d) for t, d in seen if d]
    assert checked
    for known, draft in checked:
        assert draft == head.draft(known, len(draft)), len(known)


def test_spec_mtp_needs_a_head(with_head, tmp_path: Path) -> None:
    directory, _, _ = with_head
    plain = tmp_path / "plain"
    shutil.copytree(directory, plain)
    (plain / "mtp.safetensors").unlink()
    config = json.loads((plain / "config.json").read_text())
    for key in _MTP_CONFIG_KEY.values():
        config.pop(key, None)
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no MTP"):
        make_engine(plain, spec="mtp")
    # Without --spec mtp the head is skipped at load: no weights for it.
    loaded = load_model(directory, torch.device("cpu"), torch.float32)
    assert getattr(loaded.model, "mtp", None) is None
    with_mtp = load_model(directory, torch.device("cpu"), torch.float32, with_mtp=True)
    assert with_mtp.model.mtp is not None and with_mtp.n_params > loaded.n_params


def test_spec_mtp_is_a_launch_option() -> None:
    assert p.EngineOptions(spec="mtp").spec == "mtp"


@pytest.mark.parametrize("weights", ["host", "disk"])
def test_drafting_goes_on_after_sleep_and_wake(with_head, weights: str) -> None:
    """A sleep drops the head's K/V and what it kept (the weights go with the
    model's; a disk wake reads the head again); after the wake a new request
    drafts the reference's drafts again and decodes as before."""
    directory, hf, head = with_head
    core, events = make_engine(directory, spec="mtp", draft_tokens=2)
    drafter = core.scheduler.drafter
    assert isinstance(drafter, MTPDrafter)
    tokens = prompt(94, 15)
    run_all(core, events, {"before": (tokens, greedy(6))})
    core.handle(p.Sleep(weights=weights))  # type: ignore[arg-type]
    assert drafter.kv is None
    core.handle(p.Wake())
    assert drafter.kv is not None and core.runner.model.mtp is not None
    seen = _recording(drafter)
    other = prompt(95, 13)
    got = run_all(core, events, {"after": (other, greedy(8))})["after"]
    assert got.tokens == hf_greedy(hf, other, 8)
    drafted = [(t, d) for t, d in seen if d]
    assert drafted
    for known, draft in drafted:
        assert draft == head.draft(known, len(draft)), len(known)


def test_drafting_with_an_fp8_kv_cache(with_head) -> None:
    """--kv-dtype fp8 stores the model's K/V in e4m3 (so its hidden states,
    and the head's drafts, are not transformers' exactly); the head's own
    K/V stays in the model dtype, and the output is plain decoding's."""
    directory, _, _ = with_head
    tokens = prompt(96, 17)
    plain, plain_events = make_engine(directory, kv_dtype="fp8")
    want = run_all(plain, plain_events, {"r": (tokens, greedy(10))})["r"].tokens
    core, events = make_engine(directory, spec="mtp", draft_tokens=2, kv_dtype="fp8")
    drafter = core.scheduler.drafter
    assert isinstance(drafter, MTPDrafter) and drafter.kv is not None
    assert core.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert drafter.kv[0].dtype == torch.float32
    seen = _recording(drafter)
    assert run_all(core, events, {"r": (tokens, greedy(10))})["r"].tokens == want
    assert any(draft for _, draft in seen)


def test_an_embedding_in_the_same_steps_leaves_drafting_intact(with_head) -> None:
    """An embedding request's prompt shares steps with a generating one: the
    head still runs over the generating rows, so its drafts stay the
    reference's."""
    directory, hf, head = with_head
    core, events = make_engine(directory, spec="mtp", draft_tokens=2)
    seen = _recording(core.scheduler.drafter)  # type: ignore[arg-type]
    tokens = prompt(97, 14)
    embed = p.SamplingParams(max_tokens=0, pooling="mean")
    got = run_all(core, events, {"gen": (tokens, greedy(10)), "emb": (prompt(98, 60), embed)})
    assert got["gen"].tokens == hf_greedy(hf, tokens, 10)
    drafted = [(t, d) for t, d in seen if d]
    assert drafted
    for known, draft in drafted:
        assert draft == head.draft(known, len(draft)), len(known)
