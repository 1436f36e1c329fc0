"""Request fields end to end on a single-model server started with --seed,
--chat-template and --chat-template-kwargs: overrides that take effect,
seeds that reproduce, grammars from llama.cpp's and vLLM's fields, logit_bias,
and the refusals that name their field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import Server, running_server

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{{ '<|im_start|>system\\n' + (greeting if greeting is defined else 'none') + '<|im_end|>\\n' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("request-fields")
    template = directory / "template.jinja"
    template.write_text(TEMPLATE)
    args = [str(smollm2_gguf), "--threads", "1", "--seed", "7", "--chat-template", str(template),
            "--chat-template-kwargs", '{"greeting": "ahoy-from-server"}']
    with running_server(args, directory / "router.log") as running:
        yield running


def chat(server: Server, **fields: Any) -> Any:
    return server.post("/v1/chat/completions", json={"messages": QUESTION, **fields})


def test_the_chat_template_and_its_default_kwargs_replace_the_models(server: Server) -> None:
    prompt = server.post("/apply-template", json={"messages": QUESTION}).json()["prompt"]
    assert prompt == ("<|im_start|>system\nahoy-from-server<|im_end|>\n<|im_start|>user\n"
                      "What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    own = server.post("/apply-template", json={"messages": QUESTION,
                                               "chat_template_kwargs": {"greeting": "mine"}})
    assert own.json()["prompt"].startswith("<|im_start|>system\nmine<|im_end|>")
    assert server.get("/props").json()["chat_template"] == TEMPLATE

    # Chat renders with the same template and defaults as /apply-template.
    def prompt_tokens(**fields: Any) -> int:
        return chat(server, max_tokens=1, temperature=0, **fields).json()["usage"]["prompt_tokens"]

    default = prompt_tokens()
    assert default == prompt_tokens(chat_template_kwargs={"greeting": "ahoy-from-server"})
    assert default != prompt_tokens(chat_template_kwargs={"greeting": "none"})


def test_the_server_seed_makes_sampled_answers_reproduce(server: Server) -> None:
    assert server.get("/props").json()["default_generation_settings"]["params"]["seed"] == 7
    fields = {"temperature": 1.0, "max_tokens": 16}
    first = chat(server, **fields).json()["choices"][0]["message"]["content"]
    assert chat(server, **fields).json()["choices"][0]["message"]["content"] == first
    streamed = server.post("/v1/chat/completions", json={"messages": QUESTION, "stream": True, **fields})
    pieces = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text == first
    # n choices sample with the server's seed + i: the first is the answer above.
    several = [c["message"]["content"] for c in chat(server, n=3, **fields).json()["choices"]]
    assert several[0] == first and len(set(several)) > 1


def test_grammar_fields_constrain_the_answer(server: Server) -> None:
    choice = chat(server, guided_choice=["Paris", "Lyon"], temperature=1.0, max_tokens=10).json()
    assert choice["choices"][0]["message"]["content"] in ("Paris", "Lyon")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    for fields in ({"json_schema": schema}, {"response_format": {"type": "json_object", "schema": schema}}):
        body = chat(server, temperature=0, max_tokens=40, **fields).json()
        assert isinstance(json.loads(body["choices"][0]["message"]["content"])["city"], str)
    gbnf = chat(server, grammar='root ::= "yes" | "no"', temperature=0, max_tokens=5).json()
    assert gbnf["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_grammar_that_does_not_compile_is_a_400_naming_grammar(server: Server) -> None:
    bad = chat(server, grammar="root ::= undefined_rule", max_tokens=5)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "grammar" and "undefined_rule" in bad.json()["error"]["message"]


def test_completions_logit_bias_takes_effect_and_bad_ids_are_refused(server: Server) -> None:
    token = 504  # "The" in SmolLM2's vocabulary
    body = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                "logit_bias": {str(token): 100}}).json()
    expected = server.post("/detokenize", json={"tokens": [token] * 3}).json()["content"]
    assert body["choices"][0]["text"] == expected
    bad = server.post("/v1/completions", json={"prompt": "Hello", "logit_bias": {"10000000": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    for field, value in (("logprobs", 6), ("best_of", 0), ("priority", 3)):
        refused = server.post("/v1/completions", json={"prompt": "Hello", field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, field


def test_chat_logit_bias_takes_effect_and_bad_ids_are_refused(server: Server) -> None:
    token = 504  # "The" in SmolLM2's vocabulary
    reply = chat(server, max_tokens=3, temperature=0, logit_bias={str(token): 100})
    assert reply.status_code == 200, reply.text
    expected = server.post("/detokenize", json={"tokens": [token] * 3}).json()["content"]
    assert reply.json()["choices"][0]["message"]["content"] == expected
    bad = chat(server, logit_bias={"10000000": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
