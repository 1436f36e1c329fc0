"""The per-model option table: value parsing, the flags it builds, and how a
model's settings are resolved from layers."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from protocol import EngineOptions
from router.options import (
    BY_NAME,
    OPTIONS,
    ROUTER_OPTIONS,
    OptionValueError,
    add_arguments,
    boolean,
    given_options,
    names,
    resolve_settings,
)
from router.settings import ModelSettings, SamplingOverrides

CLI_NAMES = (
    "device dtype page-size max-concurrency max-batched-tokens max-context kv-capacity "
    "prefix-cache-tokens host-kv-mib cache-ram disk-kv-path disk-kv-mib disk-kv-restore-ms "
    "device-memory-mib kv-dtype quantize gguf-weights vision mmproj mm deterministic kv-headroom-mib cuda-graph output-window threads pooling spec draft-model "
    "model-draft spec-draft-model md draft-tokens draft-max spec-draft-n-max draft-n draft "
    "spec-ngram-min spec-ngram-max expert-residency cpu-moe cmoe n-cpu-moe ncmoe "
    "expert-cache-mib moe-cache-mib ctx-checkpoints swa-checkpoints checkpoint-every-n-tokens "
    "cpent seed temp top-k top-p min-p model-suspend suspend-weights "
    "chat-template chat-template-file chat-template-kwargs reasoning-budget "
    "sleep-idle-seconds unload-idle-seconds load-timeout stop-timeout tags reranking rerank "
    "slot-save-path slots"
).split()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser


def test_the_command_line_has_exactly_the_documented_per_model_flags() -> None:
    flags = {opt for action in parser()._actions for opt in action.option_strings}
    expected = {f"--{name}" for name in CLI_NAMES} | {
        "--no-model-suspend", "--no-cuda-graph", "--no-reranking", "--no-rerank", "--no-slots",
        "--no-cpu-moe", "--no-cmoe", "--no-vision", "--no-deterministic", "-h", "--help"}
    assert flags == expected


def test_preset_only_options_are_alias_and_load_on_startup() -> None:
    assert {option.name for option in OPTIONS if option.section_only} == {"alias", "load-on-startup"}


def test_defaults_come_from_model_settings() -> None:
    assert BY_NAME["max-concurrency"].default == 8
    assert BY_NAME["kv-capacity"].default == 0
    assert BY_NAME["device"].default == "auto"
    assert BY_NAME["temp"].default is None
    assert BY_NAME["suspend-weights"].default == "disk"
    assert BY_NAME["stop-timeout"].default == 10.0
    assert BY_NAME["alias"].default == ()


def test_no_per_model_option_is_a_router_option() -> None:
    assert not ROUTER_OPTIONS & set(BY_NAME)


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("max-context", " 65536 ", 65536),
        ("page-size", "32", 32),
        ("top-k", "-1", -1),
        ("temp", "0", 0.0),
        ("top-p", "1", 1.0),
        ("min-p", "0.05", 0.05),
        ("device", "cuda:1", "cuda:1"),
        ("device", "1", "cuda:1"),
        ("device", "auto", "auto"),
        ("kv-capacity", "auto", -1),
        ("kv-capacity", "AUTO", -1),
        ("kv-capacity", "0", 0),
        ("kv-capacity", "131072", 131072),
        ("kv-headroom-mib", "2048", 2048),
        ("host-kv-mib", "4096", 4096),
        ("host-kv-mib", " auto ", -1),
        ("host-kv-mib", "0", 0),
        ("cache-ram", "-1", -1),
        ("cache-ram", "8192", 8192),
        ("cuda-graph", "off", False),
        ("dtype", "bfloat16", "bfloat16"),
        ("suspend-weights", "host", "host"),
        ("load-timeout", "2.5", 2.5),
        ("seed", str(2**64 - 1), 2**64 - 1),
        ("alias", "a, b ,c", ("a", "b", "c")),
    ],
)
def test_values_parse(name: str, text: str, value: object) -> None:
    assert BY_NAME[name].parse(text) == value


@pytest.mark.parametrize(
    ("name", "text", "reason"),
    [
        ("max-context", "32k", "expected an integer, got '32k'"),
        ("max-context", "-1", "must be >= 0, got -1"),
        ("max-concurrency", "0", "must be >= 1, got 0"),
        ("page-size", "24", "must be a power of two, got 24"),
        ("top-k", "-2", "must be >= -1, got -2"),
        ("temp", "hot", "expected a number, got 'hot'"),
        ("temp", "2.5", "must be in [0.0, 2.0], got '2.5'"),
        ("temp", "nan", "must be in [0.0, 2.0], got 'nan'"),
        ("top-p", "0", "must be in (0.0, 1.0], got '0'"),
        ("load-timeout", "0", "must be > 0.0, got '0'"),
        ("sleep-idle-seconds", "-5", "must be >= 0.0, got '-5'"),
        ("seed", str(2**64), f"must be in -1..{2**64 - 1}, got {2**64}"),
        ("seed", "-2", f"must be in -1..{2**64 - 1}, got -2"),
        ("chat-template-kwargs", "{nope", "expected a JSON object, got '{nope' (Expecting property "
         "name enclosed in double quotes: line 1 column 2 (char 1))"),
        ("chat-template-kwargs", "[1]", "expected a JSON object, got '[1]'"),
        ("chat-template-kwargs", '{"tools": []}',
         "may not set 'tools': the server sets it from each request"),
        ("chat-template", "/no/such/template.jinja", "cannot read the chat template "
         "'/no/such/template.jinja': [Errno 2] No such file or directory: '/no/such/template.jinja'"),
        ("device", "gpu", "must be auto, cpu, cuda, cuda:N or a GPU index N, got 'gpu'"),
        ("kv-capacity", "lots", "expected an integer, got 'lots'"),
        ("kv-headroom-mib", "-1", "must be >= 0, got -1"),
        ("host-kv-mib", "lots", "expected a size in MiB, 0 (off) or auto, got 'lots'"),
        ("host-kv-mib", "-2", "expected a size in MiB, 0 (off) or auto, got '-2'"),
        ("cache-ram", "4G", "expected a size in MiB, 0 (off) or auto, got '4G'"),
        ("dtype", "int8", "must be one of auto, float32, bfloat16, float16, got 'int8'"),
        ("suspend-weights", "ram", "must be one of host, disk, got 'ram'"),
        ("model-suspend", "maybe", "expected true or false, got 'maybe'"),
        ("alias", " , ", "expected one or more names separated by commas"),
        ("alias", "a,,b", "empty name in 'a,,b'"),
        ("alias", "a, a", "'a' is listed twice"),
    ],
)
def test_bad_values_say_what_is_wanted(name: str, text: str, reason: str) -> None:
    with pytest.raises(OptionValueError) as caught:
        BY_NAME[name].parse(text)
    assert str(caught.value) == reason


@pytest.mark.parametrize("text", ["true", "TRUE", "1", "on", "yes"])
def test_boolean_true(text: str) -> None:
    assert boolean(text) is True


@pytest.mark.parametrize("text", ["false", "False", "0", "off", "no"])
def test_boolean_false(text: str) -> None:
    assert boolean(text) is False


def test_names_keep_their_order() -> None:
    assert names("b,a") == ("b", "a")


def test_given_options_holds_only_what_the_command_line_said() -> None:
    args = parser().parse_args(["--max-context", "4096", "--temp", "0.2", "--threads", "1"])
    assert given_options(args) == {"max-context": 4096, "temp": 0.2, "threads": 1}
    assert given_options(parser().parse_args([])) == {}


def test_flags_can_be_turned_on_and_off() -> None:
    assert given_options(parser().parse_args(["--model-suspend"])) == {"model-suspend": True}
    assert given_options(parser().parse_args(["--no-model-suspend"])) == {"model-suspend": False}


def test_a_bad_command_line_value_names_the_flag_and_the_reason() -> None:
    with pytest.raises(argparse.ArgumentError) as caught:
        parser().parse_args(["--page-size", "3"])
    assert str(caught.value) == "argument --page-size: must be a power of two, got 3"


def test_no_layers_give_the_built_in_defaults() -> None:
    assert resolve_settings([]) == ModelSettings()


def test_every_option_lands_in_its_field() -> None:
    settings = resolve_settings([{
        "device": "cuda:1", "dtype": "bfloat16", "page-size": 32, "max-concurrency": 4,
        "max-batched-tokens": 1024, "max-context": 8192, "kv-capacity": 65536,
        "output-window": 128, "threads": 2, "seed": 7,
        "temp": 0.6, "top-k": 20, "top-p": 0.9, "min-p": 0.01,
        "model-suspend": True, "suspend-weights": "host", "sleep-idle-seconds": 60.0,
        "unload-idle-seconds": 600.0, "load-timeout": 30.0, "stop-timeout": 3.0,
        "load-on-startup": True, "alias": ("a", "b"),
    }])
    assert settings == ModelSettings(
        device="cuda:1",
        engine=EngineOptions(dtype="bfloat16", page_size=32, max_concurrency=4,
                             max_batched_tokens=1024, max_context=8192, kv_capacity_tokens=65536,
                             output_window=128, threads=2),
        sampling=SamplingOverrides(temperature=0.6, top_k=20, top_p=0.9, min_p=0.01, seed=7),
        model_suspend=True, suspend_weights="host", sleep_idle_seconds=60.0,
        unload_idle_seconds=600.0, load_timeout=30.0, stop_timeout=3.0,
        load_on_startup=True, aliases=("a", "b"),
    )


def test_later_layers_win_and_earlier_ones_fill_the_rest() -> None:
    everyone = {"max-context": 1000, "temp": 0.1, "threads": 2}
    section = {"max-context": 2000, "temp": 0.2}
    command_line = {"max-context": 3000}
    settings = resolve_settings([everyone, section, command_line])
    assert settings.engine.max_context == 3000
    assert settings.sampling.temperature == 0.2
    assert settings.engine.threads == 2
    assert settings.engine.max_concurrency == 8


def test_an_unknown_option_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown option 'max-ctx'"):
        resolve_settings([{"max-ctx": 1}])


def test_a_combination_engine_options_refuses_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"max batched tokens \(4\) must be at least"):
        resolve_settings([{"max-concurrency": 8}, {"max-batched-tokens": 4}])


def _documented_default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return "none" if not value else ", ".join(value)
    return f"{value:g}"


def test_docs_list_every_option_with_its_default() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "presets.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z-]+)` \| ([^|]*?) \|", text, flags=re.MULTILINE))
    assert {name: rows.get(name) for name in BY_NAME} == {
        option.name: _documented_default(option.default) for option in OPTIONS
    }


def test_chat_template_options_on_the_command_line(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    args = parser().parse_args(["--chat-template", str(template), "--chat-template-kwargs",
                                '{"enable_thinking": false}', "--seed", "-1"])
    given = given_options(args)
    assert given == {"chat-template": template.read_text(),
                     "chat-template-kwargs": '{"enable_thinking": false}', "seed": -1}
    settings = resolve_settings([given])
    assert settings.chat_template == template.read_text()
    assert settings.chat_template_kwargs == '{"enable_thinking": false}'
    assert settings.sampling.seed == -1
    with pytest.raises(argparse.ArgumentError, match="expected a JSON object"):
        parser().parse_args(["--chat-template-kwargs", "enable_thinking=false"])
    template.write_text("{% if %}")
    with pytest.raises(argparse.ArgumentError, match="does not compile"):
        parser().parse_args(["--chat-template", str(template)])


def test_pooling_is_an_engine_option_of_llama_cpps_values() -> None:
    option = BY_NAME["pooling"]
    assert resolve_settings([{"pooling": option.parse(" mean ")}]).engine.pooling == "mean"
    assert resolve_settings([]).engine.pooling is None  # the model's own, else last
    # llama.cpp's none (a vector per token) and rank (a reranker's head) are not served.
    for value in ("none", "rank", "max"):
        with pytest.raises(OptionValueError, match="mean, cls, last"):
            option.parse(value)



def test_kv_dtype_reaches_the_engine_bf16_by_default() -> None:
    assert BY_NAME["kv-dtype"].default == "bf16"
    assert resolve_settings([{"kv-dtype": "fp8"}]).engine.kv_dtype == "fp8"
    assert given_options(parser().parse_args(["--kv-dtype", "fp8"])) == {"kv-dtype": "fp8"}
    with pytest.raises(argparse.ArgumentError) as caught:
        parser().parse_args(["--kv-dtype", "q8_0"])
    assert str(caught.value) == "argument --kv-dtype: must be one of bf16, fp8, got 'q8_0'"
    with pytest.raises(ValueError, match="--kv-dtype must be one of bf16, fp8, got 'int8'"):
        EngineOptions(kv_dtype="int8")


def test_quantize_reaches_the_engine_off_by_default() -> None:
    assert BY_NAME["quantize"].default is None
    assert resolve_settings([{"quantize": "fp8"}]).engine.quantize == "fp8"
    assert given_options(parser().parse_args(["--quantize", "fp8"])) == {"quantize": "fp8"}
    with pytest.raises(argparse.ArgumentError) as caught:
        parser().parse_args(["--quantize", "int4"])
    assert str(caught.value) == "argument --quantize: must be one of fp8, got 'int4'"
    with pytest.raises(ValueError, match="--quantize must be one of fp8"):
        EngineOptions(device="cuda", quantize="int8")


def test_host_kv_mib_reaches_the_engine_options_off_by_default() -> None:
    assert BY_NAME["host-kv-mib"].default == 0
    assert resolve_settings([{"host-kv-mib": -1}]).engine.host_kv_mib == -1
    assert resolve_settings([{"cache-ram": 2048}]).engine.host_kv_mib == 2048
    args = parser().parse_args(["--host-kv-mib", "auto"])
    assert given_options(args) == {"host-kv-mib": -1}
    assert given_options(parser().parse_args(["--cache-ram", "-1"])) == {"cache-ram": -1}
    # The help renders (a bare percent sign in an option's help would break it).
    assert "--host-kv-mib MIB|auto" in parser().format_help()
    with pytest.raises(argparse.ArgumentError) as caught:
        parser().parse_args(["--host-kv-mib", "much"])
    assert str(caught.value) == ("argument --host-kv-mib: expected a size in MiB, 0 (off) or "
                                 "auto, got 'much'")
    with pytest.raises(ValueError, match="host KV must be a size in MiB"):
        EngineOptions(host_kv_mib=-2)


def test_the_disk_tier_options_reach_the_engine_and_bad_combinations_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert BY_NAME["disk-kv-path"].default is None and BY_NAME["disk-kv-mib"].default == 0
    assert BY_NAME["disk-kv-restore-ms"].default == 300
    monkeypatch.chdir(tmp_path)
    given = given_options(parser().parse_args(
        ["--host-kv-mib", "64", "--disk-kv-path", "kv", "--disk-kv-mib", "2048",
         "--disk-kv-restore-ms", "50"]))
    # A relative path is made absolute: the engine may run elsewhere.
    assert given["disk-kv-path"] == str(tmp_path / "kv")
    engine = resolve_settings([given]).engine
    assert (engine.disk_kv_path, engine.disk_kv_mib, engine.disk_kv_restore_ms) == (
        str(tmp_path / "kv"), 2048, 50)
    assert "--disk-kv-path DIR" in parser().format_help()
    with pytest.raises(ValueError, match=r"--disk-kv-path needs the host tier \(--host-kv-mib"):
        resolve_settings([{"disk-kv-path": "/kv", "disk-kv-mib": 1}])
    with pytest.raises(ValueError, match="--disk-kv-path needs --disk-kv-mib N"):
        resolve_settings([{"disk-kv-path": "/kv", "host-kv-mib": -1}])
    # A budget without a directory does nothing (a preset's [*] may set it).
    assert resolve_settings([{"disk-kv-mib": 100}]).engine.disk_kv_path is None
    for argv, message in ((["--disk-kv-mib", "-1"], "must be >= 0, got -1"),
                          (["--disk-kv-restore-ms", "0"], "must be >= 1, got 0"),
                          (["--disk-kv-path", " "], "expected a directory path")):
        with pytest.raises(argparse.ArgumentError, match=message):
            parser().parse_args(argv)
    with pytest.raises(ValueError, match="restore deadline at least 1 ms"):
        EngineOptions(disk_kv_restore_ms=0)


def test_speculation_options_reach_the_engine_off_by_default() -> None:
    engine = ModelSettings().engine
    assert (engine.spec, engine.draft_tokens, engine.spec_ngram_min, engine.spec_ngram_max) == (
        "none", 4, 1, 3)
    given = given_options(parser().parse_args(
        ["--spec", "ngram", "--draft-tokens", "6", "--spec-ngram-min", "2",
         "--spec-ngram-max", "4"]))
    engine = resolve_settings([given]).engine
    assert (engine.spec, engine.draft_tokens, engine.spec_ngram_min, engine.spec_ngram_max) == (
        "ngram", 6, 2, 4)
    # llama.cpp's name for the draft length, as a preset brought over writes it.
    assert resolve_settings([{"spec": "ngram", "draft-max": 8}]).engine.draft_tokens == 8
    # llama.cpp's other spellings, old and new, of the draft model and its length.
    for key in ("spec-draft-n-max", "draft-n", "draft"):
        assert resolve_settings([{"spec": "ngram", key: 6}]).engine.draft_tokens == 6
    for argv, message in ((["--spec", "eagle"], "must be one of none, ngram"),
                          (["--draft-tokens", "0"], r"must be in 1\.\.64, got 0")):
        with pytest.raises(argparse.ArgumentError, match=message):
            parser().parse_args(argv)
    with pytest.raises(ValueError, match="1 <= spec-ngram-min <= spec-ngram-max"):
        resolve_settings([{"spec-ngram-min": 4, "spec-ngram-max": 2}])


def test_a_draft_model_reaches_the_engine_from_the_command_line_and_a_preset(
        tmp_path: Path) -> None:
    from router.presets import load_preset

    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    given = given_options(parser().parse_args(["--spec", "draft", "--draft-model", str(draft)]))
    engine = resolve_settings([given]).engine
    assert (engine.spec, engine.draft_model) == ("draft", str(draft))
    # As the engine reads it from its command line.
    assert EngineOptions.from_json(engine.to_json()).draft_model == str(draft)
    # In a preset, relative to the preset's directory; llama.cpp's name too.
    preset = tmp_path / "models.ini"
    preset.write_text("[a]\nmodel = a.gguf\nspec = draft\nmodel-draft = draft.gguf\n")
    values = load_preset(preset).section("a").values()
    assert resolve_settings([values]).engine.draft_model == str(draft)
    for key in ("spec-draft-model", "md"):  # llama.cpp's newer and short names
        preset.write_text(f"[a]\nmodel = a.gguf\nspec = draft\n{key} = draft.gguf\n")
        values = load_preset(preset).section("a").values()
        assert resolve_settings([values]).engine.draft_model == str(draft)
    with pytest.raises(argparse.ArgumentError, match="does not exist"):
        parser().parse_args(["--draft-model", str(tmp_path / "missing.gguf")])
    with pytest.raises(ValueError, match="--spec draft and --draft-model go together"):
        resolve_settings([{"spec": "draft"}])
    with pytest.raises(ValueError, match="--spec draft and --draft-model go together"):
        resolve_settings([{"draft-model": str(draft)}])


def test_expert_residency_options_reach_the_engine_off_by_default(tmp_path: Path) -> None:
    from router.presets import load_preset

    engine = resolve_settings([]).engine
    assert (engine.expert_residency, engine.host_expert_layers, engine.expert_cache_mib) == (
        "device", 0, 0)
    assert not engine.host_experts and engine.host_expert_layer_count == 0
    host = resolve_settings([{"expert-residency": "host", "expert-cache-mib": 2048}]).engine
    assert (host.expert_residency, host.expert_cache_mib, host.host_expert_layer_count) == (
        "host", 2048, -1)
    # llama.cpp's names: --cpu-moe / -cmoe, --n-cpu-moe / -ncmoe, --moe-cache-mib.
    for argv, expected in ((["--cpu-moe"], ("host", 0, 0)), (["--cmoe"], ("host", 0, 0)),
                           (["--no-cpu-moe"], ("device", 0, 0)),
                           (["--n-cpu-moe", "10"], ("device", 10, 0)),
                           (["--ncmoe", "3", "--moe-cache-mib", "512"], ("device", 3, 512))):
        got = resolve_settings([given_options(parser().parse_args(argv))]).engine
        assert (got.expert_residency, got.host_expert_layers, got.expert_cache_mib) == expected
    assert given_options(parser().parse_args(["--cmoe"])) == {"cmoe": "host"}
    assert resolve_settings([{"n-cpu-moe": 10}]).engine.host_expert_layer_count == 10
    preset = tmp_path / "models.ini"
    preset.write_text("[*]\ncpu-moe = true\n[a]\nmodel = a.gguf\n"
                      "[b]\nmodel = b.gguf\ncpu-moe = false\nncmoe = 4\n")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    loaded = load_preset(preset)
    assert not loaded.ignored  # no longer llama.cpp keys we ignore
    a, b = (resolve_settings([loaded.global_options, section.values()]).engine
            for section in loaded.sections)
    assert (a.expert_residency, a.host_expert_layers) == ("host", 0)
    assert (b.expert_residency, b.host_expert_layers) == ("device", 4)
    # The command line's alias beats a preset section's other name for the field.
    top = resolve_settings([{"cmoe": "host"}, {"cpu-moe": "device"}, {"cmoe": "host"}])
    assert top.engine.expert_residency == "host"
    assert "--expert-residency {device,host}" in parser().format_help()
    with pytest.raises(argparse.ArgumentError, match="must be one of device, host"):
        parser().parse_args(["--expert-residency", "disk"])
    with pytest.raises(argparse.ArgumentError, match="must be >= 0, got -1"):
        parser().parse_args(["--n-cpu-moe", "-1"])


@pytest.mark.parametrize(("layers", "message"), [
    ([{"cpu-moe": "host", "n-cpu-moe": 4}],
     r"--expert-residency host \(--cpu-moe\) keeps every layer's experts on the host, "
     r"--n-cpu-moe 4 only the first 4 layers': give one of them"),
    # A model section's n-cpu-moe under a [*] cpu-moe: the section must turn it off.
    ([{"cpu-moe": "host"}, {"ncmoe": 4}], "give one of them"),
    ([{"expert-cache-mib": 1024}],
     "--expert-cache-mib 1024 caches host-resident experts on the device: it needs "
     r"--expert-residency host \(--cpu-moe\) or --n-cpu-moe N"),
])
def test_contradicting_or_idle_expert_options_are_refused(layers: list[dict],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_settings(layers)
    with pytest.raises(ValueError, match="expert residency must be one of device, host"):
        EngineOptions(expert_residency="disk")


def test_deterministic_reaches_the_engine_from_the_command_line_and_a_preset(
        tmp_path: Path) -> None:
    from router.presets import load_preset

    assert resolve_settings([]).engine.deterministic is False
    given = given_options(parser().parse_args(["--deterministic"]))
    engine = resolve_settings([given]).engine
    assert engine.deterministic is True
    assert EngineOptions.from_json(engine.to_json()).deterministic is True
    preset = tmp_path / "models.ini"
    preset.write_text("[*]\ndeterministic = true\n[a]\nmodel = a.gguf\n[b]\nmodel = b.gguf\n"
                      "deterministic = off\n")
    loaded = load_preset(preset)
    shared = loaded.global_options
    for name, expected in (("a", True), ("b", False)):
        section = loaded.section(name)
        assert section is not None
        assert resolve_settings([shared, section.values()]).engine.deterministic is expected
    # What the mode cannot honour stops the server at start, not at a load.
    with pytest.raises(ValueError, match="--deterministic cannot be combined with --vision"):
        resolve_settings([{"deterministic": True, "vision": True}])
