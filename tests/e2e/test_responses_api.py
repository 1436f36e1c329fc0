"""OpenAI's Responses API through the openai SDK, against a real server whose
engine answers from a script (known reasoning, text and tool calls); the
json_schema format runs on the real engine with a tiny random model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby, pairwise
from pathlib import Path

import openai
import pytest
import requests
import torch

from router.text.model_text import ModelText
from tests.support.scripted_models import ENGINE_ENV, QWEN3_SCRIPT, WEATHER_CALL, scripted_model
from tests.support.server import Server, running_server, wait_until

# One torch thread for transformers' reference beside the servers: two would
# stall each other whenever a server process takes one of the two cores.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODEL = "qwen3-scripted"
REPORT = "word " * 600  # about 4 KB as stored: three of them overfill a 0.01 MiB store
SCRIPT = {
    "rules": [
        *QWEN3_SCRIPT["rules"],
        {"when": "Find customer 42",
         "reply": "<think>\nLook it up.\n</think>\n\n<tool_call>\n{\"name\": \"crm__lookup\", "
                  "\"arguments\": {\"id\": 42}}\n</tool_call>"},
        {"when": "Write the long report", "reply": REPORT},
    ],
    "default": QWEN3_SCRIPT["default"],
}
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]},
}
CRM = {"type": "namespace", "name": "crm", "description": "Customer records.",
       "tools": [{"type": "function", "name": "lookup", "description": "Find a customer",
                  "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Path:
    directory = tmp_path_factory.mktemp("responses") / "models"
    directory.mkdir()
    scripted_model(directory / MODEL, tiny_qwen3_dir, SCRIPT)
    return directory


def _serve(models: Path, tmp: pytest.TempPathFactory, *extra: str) -> Iterator[Server]:
    with running_server(["--models-dir", str(models), "--models-max", "0", *extra],
                        tmp.mktemp("responses-log") / "router.log", env=ENGINE_ENV) as running:
        yield running


@pytest.fixture(scope="module")
def server(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(models, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def create(client: openai.OpenAI, prompt: str, **kwargs):  # type: ignore[no-untyped-def]
    return client.responses.create(model=MODEL, input=prompt, **kwargs)


def event_types(events: list) -> list[str]:
    """Event types with runs of the same delta type folded into one."""
    return [kind for kind, _ in groupby(e.type for e in events)]


# ---- function calls -------------------------------------------------------------


def test_a_function_call_round_trip_through_previous_response_id(client: openai.OpenAI) -> None:
    first = create(client, "What's the weather in Paris?", tools=[WEATHER_TOOL])
    assert first.status == "completed" and first.object == "response" and first.id.startswith("resp_")
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == "The user asks about the weather, so I call the tool."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == WEATHER_CALL
    usage = first.usage
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0

    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"sky": "sunny", "celsius": 24}'}])
    assert second.previous_response_id == first.id
    assert second.output_text == "It is sunny and 24°C in Paris."
    assert second.output[0].content[0].text == "The tool says it is sunny."
    # The history came first: the second prompt holds the first turn and the call.
    assert second.usage.input_tokens > first.usage.input_tokens + 20


def test_a_streamed_round_trip(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="What's the weather in Paris?",
                                 tools=[WEATHER_TOOL]) as stream:
        events = list(stream)
        first = stream.get_final_response()
    call = first.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == WEATHER_CALL
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == WEATHER_CALL
    with client.responses.stream(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24"}],
    ) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == "It is sunny and 24°C in Paris."


def test_namespaced_calls_come_back_with_their_namespace(client: openai.OpenAI) -> None:
    reply = create(client, "Find customer 42", tools=[CRM])
    call = reply.output[-1]
    assert (call.type, call.namespace, call.name) == ("function_call", "crm", "lookup")
    assert json.loads(call.arguments) == {"id": 42}
    # Handing the call back (with its namespace) renders it under the name the model saw.
    follow = client.responses.create(model=MODEL, tools=[CRM], input=[
        {"role": "user", "content": "Find customer 42"},
        {"type": "function_call", "call_id": call.call_id, "name": "lookup", "namespace": "crm",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Ada"},
    ])
    assert follow.status == "completed"


def test_parallel_calls_are_separate_items(client: openai.OpenAI) -> None:
    reply = create(client, "Compare Paris and Rome", tools=[WEATHER_TOOL])
    calls = [item for item in reply.output if item.type == "function_call"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.call_id for c in calls}) == len({c.id for c in calls}) == 2


# ---- streaming events -------------------------------------------------------------


def test_the_event_sequence_of_reasoning_and_text(client: openai.OpenAI) -> None:
    events = list(create(client, "Say hello", stream=True))
    assert event_types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    done = events[-1].response
    assert done.status == "completed" and done.output_text == "Hello! How can I help you today?"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == "A greeting deserves a greeting." == done.output[0].content[0].text


def test_the_event_sequence_of_a_function_call(client: openai.OpenAI) -> None:
    events = list(create(client, "What's the weather in Paris?", tools=[WEATHER_TOOL], stream=True))
    assert event_types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    numbers = [e.sequence_number for e in events]
    assert all(a < b for a, b in pairwise(numbers))
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.output_index == 1 and added.item.arguments == "" and added.item.status == "in_progress"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.item_id == added.item.id and json.loads(done.arguments) == WEATHER_CALL


def test_the_wire_format(server: Server) -> None:
    body = {"model": MODEL, "input": "Say hello", "stream": True}
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=60) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines(decode_unicode=True) if line]
    # Every event is named, and there is no [DONE] line.
    assert lines[0] == "event: response.created" and lines[1].startswith("data: {")
    assert lines[-2] == "event: response.completed"
    assert not any("[DONE]" in line for line in lines)


# ---- limits -------------------------------------------------------------------------


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    reply = create(client, "Tell me a long story", max_output_tokens=10)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 10 and reply.output[-1].status == "incomplete"
    events = list(create(client, "Tell me a long story", max_output_tokens=10, stream=True))
    assert [e.type for e in events].count("response.incomplete") == 1
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_an_engine_refusal_mid_stream_is_response_failed(client: openai.OpenAI) -> None:
    # The scripted engine refuses every grammar, as a real engine refuses a
    # schema it cannot compile: after the stream opened, so the stream says it.
    events = list(create(client, "Say hello", text={"format": {"type": "json_object"}}, stream=True))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "invalid_prompt"
    assert "does not constrain output" in failed.error.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.id)
    with pytest.raises(openai.BadRequestError):
        create(client, "Say hello", text={"format": {"type": "json_object"}})


def test_a_client_that_leaves_aborts_the_request(server: Server) -> None:
    body = {"model": MODEL, "input": "Write the long report", "stream": True}
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=60) as reply:
        for line in reply.iter_lines():
            if b"response.output_text.delta" in line:
                break
    # The report takes seconds to write; the lease ends as soon as the client goes.
    wait_until(lambda: server.load()[MODEL]["in_flight"] == 0, 2, "the request to be aborted", server)


# ---- the store ---------------------------------------------------------------------


def test_get_delete_and_input_items(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, instructions="Be kind.", metadata={"team": "a"}, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Say hello"},
    ])
    again = client.responses.retrieve(reply.id)
    assert again.model_dump() == reply.model_dump()
    assert again.instructions == "Be kind." and again.metadata == {"team": "a"}

    items = client.responses.input_items.list(reply.id)
    assert [i.role for i in items.data] == ["user", "assistant", "user", "developer"]  # newest first
    assert items.data[3].content[0].text == "Answer briefly." and items.data[3].type == "message"
    assert items.data[1].content[0].type == "output_text"
    page = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [i.role for i in page.data] == ["developer", "user"] and page.has_more
    rest = client.responses.input_items.list(reply.id, order="asc", after=page.last_id)
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more
    assert page.first_id == page.data[0].id

    assert client.responses.delete(reply.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(reply.id)


def test_deleting_the_parent_mid_stream_fails_the_continuation(server: Server) -> None:
    parent = requests.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Say hello"},
                           timeout=60).json()["id"]
    body = {"model": MODEL, "input": "Write the long report", "previous_response_id": parent,
            "stream": True}
    events = []
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines(decode_unicode=True)
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if events[-1]["type"] == "response.output_text.delta":
                    break
        # The report takes seconds to write: the DELETE lands mid-generation.
        deleted = requests.delete(f"{server.url}/v1/responses/{parent}", timeout=10)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        events += [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    failed = events[-1]
    assert failed["type"] == "response.failed", [e["type"] for e in events[-3:]]
    assert parent in failed["response"]["error"]["message"]
    assert "deleted" in failed["response"]["error"]["message"]
    # Nothing was stored that continues the deleted response, and the engine
    # request was aborted rather than written to the end.
    child = failed["response"]["id"]
    assert requests.get(f"{server.url}/v1/responses/{child}", timeout=10).status_code == 404
    assert sum(e["type"] == "response.output_text.delta" for e in events) < 300
    wait_until(lambda: server.load()[MODEL]["in_flight"] == 0, 2, "the request to end", server)


def test_deleting_the_parent_fails_a_whole_continuation(server: Server) -> None:
    parent = requests.post(server.url + "/v1/responses", json={"model": MODEL, "input": "Say hello"},
                           timeout=60).json()["id"]
    body = {"model": MODEL, "input": "Write the long report", "previous_response_id": parent}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, server.url + "/v1/responses", json=body, timeout=60)
        # In flight means its conversation is pinned and it is generating.
        wait_until(lambda: server.load()[MODEL]["in_flight"] == 1, 10, "the continuation to run", server)
        assert requests.delete(f"{server.url}/v1/responses/{parent}", timeout=10).status_code == 200
        reply = answer.result()
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    assert requests.get(f"{server.url}/v1/responses/{parent}", timeout=10).status_code == 404


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    reply = create(client, "Say hello", store=False)
    assert reply.output_text == "Hello! How can I help you today?"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)
    with pytest.raises(openai.BadRequestError) as error:
        create(client, "Say hello", previous_response_id=reply.id)
    assert error.value.code == "previous_response_not_found"
    assert error.value.param == "previous_response_id"
    assert error.value.body["message"] == f"Previous response with id '{reply.id}' not found."


def test_input_tokens_are_counted_as_the_prompt_is(client: openai.OpenAI) -> None:
    counted = client.responses.input_tokens.count(model=MODEL, input="Say hello", instructions="Be kind.")
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == create(client, "Say hello", instructions="Be kind.").usage.input_tokens


@pytest.fixture(scope="module")
def count_store(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(models, tmp_path_factory, "--response-store-max-records", "2")


@pytest.fixture(scope="module")
def byte_store(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir: Path) -> Iterator[Server]:
    # Nothing acts mid-stream here: the three 600-token reports run unpaced.
    unpaced = tmp_path_factory.mktemp("responses-unpaced") / "models"
    unpaced.mkdir()
    scripted_model(unpaced / MODEL, tiny_qwen3_dir, {**SCRIPT, "step_seconds": 0})
    # Room for two long reports (about 4 KB each as stored) but not three.
    yield from _serve(unpaced, tmp_path_factory, "--response-store-max-mib", "0.01")


def test_counting_tokens_loads_no_model(count_store: Server) -> None:
    body = {"model": MODEL, "input": "Say hello"}
    counted = count_store.post("/v1/responses/input_tokens", json=body).json()
    assert counted["input_tokens"] > 5
    (status,) = [m["status"]["value"] for m in count_store.get("/v1/models").json()["data"]]
    assert status == "unloaded"


def test_the_store_keeps_the_most_recent_records(count_store: Server) -> None:
    client = openai.OpenAI(base_url=count_store.url + "/v1", api_key="x", max_retries=0)
    ids = [create(client, "Say hello").id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    assert f"evicted {ids[0]}" in count_store.log()


def test_the_store_keeps_within_its_bytes(byte_store: Server) -> None:
    client = openai.OpenAI(base_url=byte_store.url + "/v1", api_key="x", max_retries=0)
    first, second, third = (create(client, "Write the long report").id for _ in range(3))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first)
    assert client.responses.retrieve(second).output_text == REPORT
    assert client.responses.retrieve(third).output_text == REPORT
    assert f"evicted {first}" in byte_store.log()


# ---- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type"),
        ({"tools": [{"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
                     "environment": "linux"}]}, "tools[0].type"),
        ({"tools": [{"type": "image_generation"}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"}]},
         "tools[0].type"),
        ({"conversation": "conv_123"}, "conversation"),
        ({"context_management": [{"type": "compaction", "compact_threshold": 2000}]}, "context_management"),
        ({"prompt": {"id": "pmpt_123"}}, "prompt"),
        ({"input": [{"type": "compaction", "encrypted_content": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].image_url"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"temperature": 5}, "temperature"),
    ],
)
def test_what_we_cannot_do_is_a_400_naming_the_field(server: Server, extra: dict, param: str) -> None:
    response = server.post("/v1/responses", json={"model": MODEL, "input": "Say hello", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_an_input_too_long_for_the_context_names_input(server: Server) -> None:
    response = server.post("/v1/responses", json={"model": MODEL, "input": "word " * 3000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")


def test_neutral_values_and_unknown_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = create(client, "Say hello", background=False, truncation="disabled", service_tier="auto",
                   top_logprobs=0, include=["reasoning.encrypted_content"], prompt_cache_key="k",
                   reasoning={"effort": "medium", "summary": "auto"}, text={"verbosity": "medium"},
                   user="me", extra_body={"something_new": 1})
    assert reply.status == "completed" and reply.user == "me"
    assert reply.reasoning.summary == "auto" and reply.text.format.type == "text"


def test_unknown_responses_are_404s(server: Server) -> None:
    for method, path in [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")]:
        response = requests.request(method, server.url + path, timeout=10)
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "Response with id 'resp_nope' not found."


def test_the_v1_v1_path_answers_too(server: Server) -> None:
    reply = server.post("/v1/v1/responses", json={"model": MODEL, "input": "Say hello"}).json()
    assert reply["output"][-1]["content"][0]["text"] == "Hello! How can I help you today?"


# ---- structured output on the real engine -------------------------------------------------

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def real_engine(tiny_qwen3_server: Server) -> Server:
    return tiny_qwen3_server  # tests/e2e/conftest.py: one server for the package


def test_json_schema_output_on_the_real_engine(real_engine: Server) -> None:
    client = openai.OpenAI(base_url=real_engine.url + "/v1", api_key="x", max_retries=0, timeout=300)
    reply = client.responses.create(
        model="tiny", input="Answer with a JSON object.", reasoning={"effort": "none"},
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
        max_output_tokens=200, temperature=0)
    assert reply.status == "completed", reply.model_dump()
    answer = json.loads(reply.output_text)
    assert set(answer) == {"ok", "count"} and isinstance(answer["ok"], bool) and 0 <= answer["count"] <= 9
    assert reply.text.format.type == "json_schema"


# ---- output_text logprobs, on the real engine with SmolLM2 (real weights) ----------------

QUESTION = "What is the capital of France?"
INCLUDE = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def smollm2_client(smollm2_server: Server) -> openai.OpenAI:
    """SmolLM2 served alone (tests/e2e/conftest.py)."""
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_output_text_logprobs_equal_transformers(smollm2_client: openai.OpenAI, smollm2_gguf: Path,
                                                 smollm2_reference: torch.nn.Module) -> None:
    reply = smollm2_client.responses.create(model="smollm2", input=QUESTION, include=INCLUDE,
                                            top_logprobs=3, temperature=0, max_output_tokens=24)
    assert "Paris" in reply.output_text and reply.top_logprobs == 3
    (part,) = reply.output[0].content
    entries = part.logprobs
    assert "".join(e.token for e in entries) == part.text
    # The same prompt through transformers: greedy, so the same tokens.
    text = ModelText.load(smollm2_gguf)
    prompt = text.encode_prompt(text.render_chat([{"role": "user", "content": QUESTION}]))
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        for _ in entries:
            ids = torch.cat([ids, smollm2_reference(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        expected = torch.log_softmax(smollm2_reference(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    tokens = ids[0, len(prompt):].tolist()
    for position, entry in enumerate(entries):
        row = expected[position]
        assert entry.token == text.tokenizer.decode([tokens[position]])
        assert bytes(entry.bytes) == entry.token.encode()
        assert entry.logprob == pytest.approx(float(row[tokens[position]]), abs=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-3)
        assert entry.top_logprobs[0].token == entry.token
    # Kept as returned: the stored response lists the same.
    assert smollm2_client.responses.retrieve(reply.id).output[0].content[0].logprobs == entries


def test_streamed_deltas_carry_their_tokens_logprobs(smollm2_client: openai.OpenAI) -> None:
    whole = smollm2_client.responses.create(model="smollm2", input=QUESTION, include=INCLUDE,
                                            top_logprobs=2, temperature=0, max_output_tokens=24)
    events = list(smollm2_client.responses.create(model="smollm2", input=QUESTION, include=INCLUDE,
                                                  top_logprobs=2, temperature=0, max_output_tokens=24,
                                                  stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    expected = whole.output[0].content[0].logprobs
    streamed = [entry for delta in deltas for entry in delta.logprobs]
    assert all(delta.logprobs for delta in deltas)  # one token per step, each shown at once
    for got in (streamed, done.logprobs):
        assert [(e.token, e.logprob) for e in got] == [(e.token, e.logprob) for e in expected]
        assert [[t.token for t in e.top_logprobs] for e in got] == \
            [[t.token for t in e.top_logprobs] for e in expected]
    assert events[-1].response.output[0].content[0].logprobs == expected


def test_top_logprobs_without_the_include_returns_none(smollm2_client: openai.OpenAI) -> None:
    reply = smollm2_client.responses.create(model="smollm2", input=QUESTION, top_logprobs=5,
                                            temperature=0, max_output_tokens=8)
    assert reply.output[0].content[0].logprobs == []
