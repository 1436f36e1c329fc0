"""ModelText.load on each artifact kind: what it finds, what it refuses, and how fast."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.text import ModelText, TemplateError
from router.text.chat_template import CHATML_TEMPLATE

QWEN_EOS, QWEN_ENDOFTEXT = 151645, 151643


def test_smollm2_gguf(smollm2_gguf: Path) -> None:
    start = time.perf_counter()
    model = ModelText.load(smollm2_gguf)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"loading SmolLM2's text side took {elapsed:.2f} s"
    assert model.eos_token_ids == (2,)
    assert model.bos_token_id == 1
    assert model.context_length == 8192
    assert model.template_origin == "gguf"
    assert model.tokenizer.vocab_size == 49152
    assert model.special_tokens["eos_token"] == "<|im_end|>"


def test_gguf_without_template_falls_back_to_chatml(qwen2_gguf: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        model = ModelText.load(qwen2_gguf)
    assert "no chat template; using ChatML" in caplog.text
    assert model.template_origin == "chatml-fallback"
    assert model.eos_token_ids == (QWEN_EOS, QWEN_ENDOFTEXT)  # eos, then eot
    assert model.context_length == 40960
    assert model.bos_token_id == QWEN_ENDOFTEXT and not model.tokenizer.add_bos_token
    prompt = model.render_chat([{"role": "user", "content": "hi"}])
    assert model.encode_prompt(prompt) == [151644, 872, 198, 6023, QWEN_EOS, 198, 151644, 77091, 198]


def test_directory_holding_one_gguf(smollm2_gguf: Path, tmp_path: Path) -> None:
    os.symlink(smollm2_gguf, tmp_path / smollm2_gguf.name)
    (tmp_path / "README.md").write_text("not a model")
    model = ModelText.load(tmp_path)
    assert model.path.name == smollm2_gguf.name and model.eos_token_ids == (2,)


def test_directory_with_several_ggufs_is_ambiguous(smollm2_gguf: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        os.symlink(smollm2_gguf, tmp_path / name)
    with pytest.raises(ValueError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        ModelText.load(tmp_path)


def test_split_gguf_uses_the_first_shard(smollm2_gguf: Path, tmp_path: Path) -> None:
    for n in (1, 2):
        os.symlink(smollm2_gguf, tmp_path / f"model-0000{n}-of-00002.gguf")
    assert ModelText.load(tmp_path).path.name == "model-00001-of-00002.gguf"


def test_tiny_qwen3_hf_directory(tiny_qwen3_dir: Path) -> None:
    start = time.perf_counter()
    model = ModelText.load(tiny_qwen3_dir)
    assert time.perf_counter() - start < 5.0
    assert QWEN_EOS in model.eos_token_ids
    assert model.bos_token_id is None  # Qwen names no BOS and adds none
    assert model.context_length == 2048
    assert model.template_origin == "tokenizer_config.json"
    prompt = model.render_chat([{"role": "user", "content": "hi"}])
    assert model.encode_prompt(prompt)[:3] == [151644, 872, 198]


def test_eos_priority_generation_config_then_config_then_tokenizer(
        qwen3_tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir / name, tmp_path / name)
    assert ModelText.load(tmp_path).eos_token_ids == (QWEN_EOS,)  # tokenizer_config eos_token
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": QWEN_ENDOFTEXT,
                                                      "max_position_embeddings": 4096}))
    model = ModelText.load(tmp_path)
    assert model.eos_token_ids == (QWEN_ENDOFTEXT,) and model.context_length == 4096
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [QWEN_EOS, QWEN_ENDOFTEXT]}))
    assert ModelText.load(tmp_path).eos_token_ids == (QWEN_EOS, QWEN_ENDOFTEXT)


def test_template_priority_and_chatml_fallback(qwen3_tokenizer_dir: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    config = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())
    shutil.copyfile(qwen3_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    hello = [{"role": "user", "content": "hi"}]

    config["chat_template"] = [{"name": "default", "template": "D{{ messages | length }}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    model = ModelText.load(tmp_path)
    assert model.render_chat(hello) == "D1"
    assert model.render_chat(hello, tools=[{"type": "function"}]) == "T1"

    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}\n")
    model = ModelText.load(tmp_path)
    assert model.template_origin == "chat_template.jinja" and model.render_chat(hello) == "Jhi"

    (tmp_path / "chat_template.jinja").write_text("{% if %}broken")
    with caplog.at_level("WARNING"):
        model = ModelText.load(tmp_path)
    assert "does not compile" in caplog.text
    assert model.template_origin == "chatml-fallback"
    assert model.template.source == CHATML_TEMPLATE

    (tmp_path / "chat_template.jinja").unlink()
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    caplog.clear()
    with caplog.at_level("INFO"):
        model = ModelText.load(tmp_path)
    assert "no chat template; using ChatML" in caplog.text
    assert model.render_chat(hello) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_encode_prompt_adds_bos_once(spm_gguf: Path) -> None:
    model = ModelText.load(spm_gguf)  # a SentencePiece vocabulary that asks for BOS
    assert model.tokenizer.add_bos_token and model.bos_token_id == 1
    plain = model.encode_prompt("hello")
    assert plain[0] == 1 and plain[1:] == model.tokenizer.encode("hello")
    written = model.encode_prompt("<s>hello")  # a template that writes BOS itself
    assert written.count(1) == 1 and written[0] == 1


def test_encode_prompt_without_bos(smollm2_text: ModelText, qwen3_text: ModelText) -> None:
    assert smollm2_text.encode_prompt("hello") == smollm2_text.tokenizer.encode("hello")
    assert qwen3_text.encode_prompt("<|im_start|>x")[0] == 151644


def test_render_errors_are_template_errors(smollm2_text: ModelText) -> None:
    with pytest.raises(TemplateError):
        smollm2_text.render_chat([{"role": "user"}])  # SmolLM2 concatenates message['content']


@pytest.mark.parametrize("make", [
    lambda d: d / "missing",
    lambda d: (d / "empty").mkdir() or d / "empty",
    lambda d: (d / "weights.bin").write_bytes(b"x") and d / "weights.bin",
    lambda d: (d / "fake.gguf").write_bytes(b"NOPE" + bytes(20)) and d / "fake.gguf",
])
def test_bad_paths_raise_value_error(tmp_path: Path, make) -> None:
    with pytest.raises(ValueError):
        ModelText.load(make(tmp_path))


def test_sentencepiece_only_directory_is_explained(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        ModelText.load(tmp_path)


def test_router_text_imports_nothing_heavy(smollm2_gguf: Path) -> None:
    code = (
        "import sys\n"
        "from router.text import ModelText, IncrementalDetokenizer, StopStringMatcher\n"
        f"m = ModelText.load({str(smollm2_gguf)!r})\n"
        "m.encode_prompt(m.render_chat([{'role': 'user', 'content': 'hi'}]))\n"
        "heavy = {'torch', 'cupy', 'numpy', 'gguf', 'jinja2', 'transformers', 'engine', 'kernels'}\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3], check=True)
    assert done.stdout.strip() == "[]"


def test_long_conversations_render_off_the_event_loop(qwen3_tokenizer_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import threading

    from router.text.chat_template import ChatTemplate

    model = ModelText.load(qwen3_tokenizer_dir)
    threads: list[str] = []
    render = ChatTemplate.render

    def recording(self: ChatTemplate, *args: object, **kwargs: object) -> str:
        threads.append(threading.current_thread().name)
        return render(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ChatTemplate, "render", recording)
    short = [{"role": "user", "content": "hi"}]
    long = [{"role": "user", "content": "word " * 10_000}]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(201)]
    for messages in (short, long, many):
        prompt = asyncio.run(model.render_chat_async(messages))
        assert prompt == render(model.template, messages, **model.special_tokens)
    main = threading.current_thread().name
    assert threads[0] == main  # a short chat is not worth a thread hop
    assert threads[1].startswith("roundhouse-text") and threads[2].startswith("roundhouse-text")
