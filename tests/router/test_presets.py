"""The preset parser: llama.cpp's INI format, and an error with file:line for
everything it refuses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from router.presets import Preset, PresetError, PresetValue, load_preset, parse_preset

ROOT = Path(__file__).resolve().parents[2]
INI = Path("models.ini")

FULL = """\
; a comment
# another comment
version = 1

[*]
max-concurrency = 4
model-suspend = true

[qwen3-8b]
  max-context   =   32768
temp = 0.6
load-on-startup = true
alias = qwen, q

[coder]
model = ../models/coder.gguf
alias = code
""".replace("32768", "32768  ")  # trailing spaces are ignored too


def parse(text: str) -> Preset:
    return parse_preset(text, INI)


def test_a_full_preset() -> None:
    preset = parse(FULL)
    assert preset.path == INI
    assert preset.version == 1
    assert preset.global_section is not None
    assert preset.global_section.line == 5
    assert preset.global_options == {"max-concurrency": 4, "model-suspend": True}
    assert [s.name for s in preset.sections] == ["qwen3-8b", "coder"]
    qwen = preset.section("qwen3-8b")
    assert qwen is not None
    assert qwen.line == 9
    assert qwen.model is None
    assert qwen.options["max-context"] == PresetValue(32768, 10)
    assert qwen.values() == {"max-context": 32768, "temp": 0.6, "load-on-startup": True,
                             "alias": ("qwen", "q")}
    assert qwen.aliases == ("qwen", "q")
    assert qwen.load_on_startup is True
    coder = preset.section("coder")
    assert coder is not None
    assert (coder.model, coder.model_line) == ("../models/coder.gguf", 16)
    assert coder.aliases == ("code",)
    assert coder.load_on_startup is False
    assert "model" not in coder.values()


def test_version_is_optional_and_an_empty_file_is_an_empty_preset() -> None:
    assert parse("[a]\nmodel = a.gguf\n").version is None
    empty = parse("; nothing here\n\n")
    assert (empty.version, empty.global_section, empty.sections) == (None, None, ())


def test_windows_line_ends_a_byte_order_mark_and_no_final_newline() -> None:
    preset = parse("\ufeffversion = 1\r\n[a]\r\nmodel = a.gguf\r\ntemp = 0.5")
    section = preset.section("a")
    assert section is not None
    assert section.model == "a.gguf"
    assert section.options["temp"] == PresetValue(0.5, 4)


def test_section_names_may_hold_slashes_and_colons() -> None:
    preset = parse("[ggml-org/gemma-3-4b-it-GGUF:Q4_K_M]\nmodel = g.gguf\n")
    assert preset.sections[0].name == "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M"


def test_model_paths_are_relative_to_the_preset_directory(tmp_path: Path) -> None:
    preset = parse_preset("[a]\nmodel = sub/a.gguf\n[b]\nmodel = /abs/b.gguf\n[c]\nmodel = ~/c.gguf\n",
                          tmp_path / "conf" / "models.ini")
    a, b, c = preset.sections
    assert preset.model_path(a) == tmp_path / "conf" / "sub" / "a.gguf"
    assert preset.model_path(b) == Path("/abs/b.gguf")
    assert preset.model_path(c) == Path("~/c.gguf").expanduser()


def test_a_relative_preset_path_still_gives_absolute_model_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    preset = parse_preset("[a]\nmodel = a.gguf\n", Path("conf/models.ini"))
    assert preset.model_path(preset.sections[0]) == tmp_path / "conf" / "a.gguf"


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("[a]\ntemp 0.6\n", 2, "expected [section], key = value or a comment, got 'temp 0.6'"),
        ("[a]\n[b\n", 2, "malformed section header '[b'"),
        ("[a]]\n", 1, "malformed section header '[a]]'"),
        ("[ ]\n", 1, "empty section name []"),
        ("temp = 0.6\n[a]\n", 1,
         "option 'temp' comes before any [section]; put it under [*] to apply it to every model"),
        ("version = 2\n", 1, "unsupported preset version '2' (this server reads version 1)"),
        ("version = 1\nversion = 1\n", 2, "duplicate key 'version' (first on line 1)"),
        ("[a]\nversion = 1\n", 2, "'version' goes at the top of the file, before any section"),
        ("[*]\nmax-ctx = 4096\n", 2, "unknown option 'max-ctx' (did you mean 'max-context'?)"),
        ("[*]\nctx-size = 4096\n", 2, "unknown option 'ctx-size' (did you mean 'max-context'?)"),
        ("[*]\nn-gpu-layerz = 99\n", 2, "unknown option 'n-gpu-layerz' (did you mean "
         "'n-gpu-layers', a llama.cpp option Roundhouse ignores?)"),
        ("[*]\nhf-rep = a/b\n", 2, "unknown option 'hf-rep' (did you mean 'hf-repo', a llama.cpp "
         "option Roundhouse ignores?)"),
        ("[*]\n--temp = 0.5\n", 2, "malformed key '--temp'; write 'temp', without dashes"),
        ("[*]\nmax context = 5\n", 2, "malformed key 'max context'"),
        ("[*]\n= 5\n", 2, "malformed key ''"),
        ("[a]\nport = 8080\n", 2, "option 'port' applies to the whole router; give it on the command line"),
        ("[*]\nhost = 0.0.0.0\n", 2, "option 'host' applies to the whole router; give it on the command line"),
        ("[*]\nmodels-dir = /m\n", 2,
         "option 'models-dir' applies to the whole router; give it on the command line"),
        ("[*]\nmodels-max = 2\n", 2,
         "option 'models-max' applies to the whole router; give it on the command line"),
        ("[a]\nmax-context = 32k\n", 2, "option 'max-context': expected an integer, got '32k'"),
        ("[a]\ntop-p = 1.5\n", 2, "option 'top-p': must be in (0.0, 1.0], got '1.5'"),
        ("[a]\nmodel-suspend = maybe\n", 2, "option 'model-suspend': expected true or false, got 'maybe'"),
        ("[a]\ntemp = 0.6 ; cool\n", 2, "option 'temp': expected a number, got '0.6 ; cool'"),
        ("[a]\nmax-context =\n", 2, "option 'max-context': expected an integer, got ''"),
        ("[a]\nmodel = a.gguf\n\n[a]\n", 4, "duplicate section [a] (first on line 1)"),
        ("[*]\n[*]\n", 2, "duplicate section [*] (first on line 1)"),
        ("[a]\ntemp = 0.1\ntemp = 0.2\n", 3, "duplicate key 'temp' in [a] (first on line 2)"),
        ("[a]\nmodel = a.gguf\nmodel = b.gguf\n", 3, "duplicate key 'model' in [a] (first on line 2)"),
        ("[*]\nmodel = a.gguf\n", 2, "'model' is set per model; it cannot go in [*]"),
        ("[*]\nalias = a\n", 2, "'alias' is set per model; it cannot go in [*]"),
        ("[*]\nload-on-startup = true\n", 2, "'load-on-startup' is set per model; it cannot go in [*]"),
        ("[a]\nmodel =\n", 2, "'model' needs a path"),
        ("[a]\nalias = x, x\n", 2, "option 'alias': 'x' is listed twice"),
        ("[a]\nhost-kv-mib = 4G\n", 2,
         "option 'host-kv-mib': expected a size in MiB, 0 (off) or auto, got '4G'"),
        ("[*]\ncram = 4096\n", 2, "unknown option 'cram' (did you mean 'cache-ram'?)"),
    ],
)
def test_errors_carry_the_file_the_line_and_the_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(PresetError) as caught:
        parse(text)
    assert (caught.value.path, caught.value.line, caught.value.reason) == (INI, line, reason)
    assert str(caught.value) == f"models.ini:{line}: {reason}"


def test_line_numbers_count_comments_and_blank_lines() -> None:
    with pytest.raises(PresetError) as caught:
        parse("; one\n\n# three\n[*]\n\n; six\nmax-ctx = 1\n")
    assert str(caught.value).startswith("models.ini:7: unknown option 'max-ctx'")


def test_a_preset_error_is_a_value_error() -> None:
    assert issubclass(PresetError, ValueError)


def test_a_missing_file_is_a_preset_error_without_a_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.ini"
    with pytest.raises(PresetError) as caught:
        load_preset(missing)
    assert caught.value.line is None
    assert str(caught.value).startswith(f"{missing}: cannot read the preset: ")


def test_load_preset_reads_the_file(tmp_path: Path) -> None:
    path = tmp_path / "models.ini"
    path.write_text(FULL)
    preset = load_preset(path)
    assert preset.path == path
    assert [s.name for s in preset.sections] == ["qwen3-8b", "coder"]


@pytest.mark.parametrize("example", sorted((ROOT / "presets").glob("*.ini")), ids=lambda p: p.name)
def test_the_shipped_example_presets_parse(example: Path) -> None:
    preset = load_preset(example)
    assert preset.sections


def test_llama_cpp_options_roundhouse_does_not_use_are_accepted_with_one_warning(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    path = tmp_path / "models.ini"
    path.write_text("[*]\nn-gpu-layers = 99\nflash-attn = on\n[coder]\nmodel = c.gguf\n"
                    "hf-repo = org/model:Q4_K_M\nspec-draft-hf = org/draft\ndedup-cache-models = true\n"
                    "temp = 0.5\n")
    with caplog.at_level(logging.WARNING, logger="router.presets"):
        preset = load_preset(path)
    assert preset.section("coder").values() == {"temp": 0.5}
    assert preset.global_options == {}
    # pooling is llama.cpp's key and ours (an embeddings option), read like any other.
    assert parse("[m]\nmodel = m.gguf\npooling = cls\n").section("m").values() == {
        "pooling": "cls"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"preset {path}: ignoring llama.cpp options Roundhouse does not use: n-gpu-layers (line 2), "
        "flash-attn (line 3), hf-repo (line 6), spec-draft-hf (line 7), dedup-cache-models (line 8)"
    ]


def test_chat_template_paths_are_relative_to_the_preset(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    path = tmp_path / "models.ini"
    path.write_text("[a]\nmodel = a.gguf\nchat-template = t.jinja\n"
                    "chat-template-kwargs = {\"enable_thinking\": false}\n")
    values = load_preset(path).section("a").values()
    assert values == {"chat-template": "{{ messages[0]['content'] }}",
                      "chat-template-kwargs": '{"enable_thinking": false}'}
    path.write_text("[a]\nmodel = a.gguf\nchat-template = missing.jinja\n")
    with pytest.raises(PresetError, match="option 'chat-template': cannot read the chat template"):
        load_preset(path)
    path.write_text("[a]\nmodel = a.gguf\nchat-template = {% for %}\n")
    with pytest.raises(PresetError, match=r"models\.ini:3: option 'chat-template': the chat "
                       r"template does not compile"):
        load_preset(path)


def test_the_host_tier_size_is_a_preset_key_with_llama_cpps_name_too() -> None:
    preset = parse("[*]\nhost-kv-mib = auto\n[a]\nmodel = a.gguf\ncache-ram = 8192\n")
    assert preset.global_options == {"host-kv-mib": -1}
    assert preset.section("a").values() == {"cache-ram": 8192}


def test_the_disk_tier_keys_with_a_path_relative_to_the_preset(tmp_path: Path) -> None:
    path = tmp_path / "models.ini"
    path.write_text("[*]\nhost-kv-mib = 256\ndisk-kv-mib = 4096\n"
                    "[a]\nmodel = a.gguf\ndisk-kv-path = kv-cache\ndisk-kv-restore-ms = 100\n")
    preset = load_preset(path)
    assert preset.global_options == {"host-kv-mib": 256, "disk-kv-mib": 4096}
    assert preset.section("a").values() == {"disk-kv-path": str(tmp_path / "kv-cache"),
                                            "disk-kv-restore-ms": 100}
