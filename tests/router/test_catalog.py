"""build_catalog: the models a configuration serves, each with settings
resolved as command line > the model's section > [*] > built-in defaults."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from router.catalog import Catalog, build_catalog
from router.config import ServeConfig
from router.presets import PresetError
from router.settings import ModelSettings

ROOT = Path(__file__).resolve().parents[2]


def gguf(path: Path) -> Path:
    # The catalog only looks at names and files, never at the weights.
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def hf_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "models"
    gguf(directory / "alpha.gguf")
    gguf(directory / "beta.gguf")
    return directory


def write_preset(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.ini"
    path.write_text(text)
    return path


def router(models_dir: Path | None = None, preset: Path | None = None,
           **options: Any) -> Catalog:
    return build_catalog(ServeConfig(models_dir=models_dir, models_preset=preset,
                                     cli_model_options=options))


def settings(catalog: Catalog, model_id: str) -> ModelSettings:
    return catalog.entries[model_id].settings


def test_a_single_model_is_named_after_its_file(tmp_path: Path) -> None:
    path = gguf(tmp_path / "SmolLM2-135M.Q4_1.gguf")
    catalog = build_catalog(ServeConfig(model=path, cli_model_options={"threads": 1},
                                        aliases=("smol", "tiny")))
    entry = catalog.entries["SmolLM2-135M.Q4_1"]
    assert (entry.path, entry.format) == (path, "gguf")
    assert entry.settings.engine.threads == 1
    assert entry.settings.aliases == ("smol", "tiny")
    # A single-model server loads its model at start-up.
    assert entry.settings.load_on_startup is True
    assert catalog.aliases == {"smol": "SmolLM2-135M.Q4_1", "tiny": "SmolLM2-135M.Q4_1"}
    assert catalog.find("tiny") is entry


def test_a_single_hf_directory_is_named_after_the_directory(tmp_path: Path) -> None:
    path = hf_dir(tmp_path / "qwen3-0.6b")
    catalog = build_catalog(ServeConfig(model=path))
    assert list(catalog.entries) == ["qwen3-0.6b"]
    assert catalog.entries["qwen3-0.6b"].format == "hf"


def test_a_single_model_alias_may_not_be_its_own_id(tmp_path: Path) -> None:
    path = gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="alias 'm' of model 'm' is the model's own id"):
        build_catalog(ServeConfig(model=path, aliases=("m",)))


def test_a_single_model_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build_catalog(ServeConfig(model=tmp_path / "none.gguf"))


def test_models_dir_alone_gives_defaults_and_command_line_options(models_dir: Path) -> None:
    catalog = router(models_dir, **{"max-context": 4096})
    assert list(catalog.entries) == ["alpha", "beta"]
    for model_id in ("alpha", "beta"):
        assert settings(catalog, model_id).engine.max_context == 4096
        assert settings(catalog, model_id).load_on_startup is False
    assert catalog.aliases == {}


def test_precedence_command_line_over_section_over_star_over_default(
        tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, """\
[*]
max-context = 1000
threads = 2

[alpha]
max-context = 2000
temp = 0.3
""")
    catalog = router(models_dir, preset)
    assert settings(catalog, "alpha").engine.max_context == 2000  # section over [*]
    assert settings(catalog, "alpha").engine.threads == 2         # [*] fills in
    assert settings(catalog, "alpha").sampling.temperature == 0.3
    assert settings(catalog, "beta").engine.max_context == 1000   # [*] alone
    assert settings(catalog, "beta").sampling.temperature is None
    assert settings(catalog, "beta").engine.page_size == 16        # built-in default

    catalog = router(models_dir, preset, **{"max-context": 3000, "temp": 0.9})
    assert settings(catalog, "alpha").engine.max_context == 3000  # command line over all
    assert settings(catalog, "alpha").sampling.temperature == 0.9
    assert settings(catalog, "beta").engine.max_context == 3000


def test_a_command_line_flag_turns_off_what_a_preset_turned_on(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[*]\nmodel-suspend = true\n[alpha]\nsuspend-weights = host\n")
    assert settings(router(models_dir, preset), "alpha").model_suspend is True
    catalog = router(models_dir, preset, **{"model-suspend": False})
    assert settings(catalog, "alpha").model_suspend is False
    assert settings(catalog, "alpha").suspend_weights == "host"


def test_a_models_dir_model_configured_by_its_section(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[beta]\nload-on-startup = true\nalias = b, second\n")
    catalog = router(models_dir, preset)
    beta = catalog.entries["beta"]
    assert beta.path == models_dir / "beta.gguf"
    assert beta.settings.load_on_startup is True
    assert beta.settings.aliases == ("b", "second")
    assert catalog.aliases == {"b": "beta", "second": "beta"}
    assert catalog.find("second") is beta
    assert catalog.find("alpha") is catalog.entries["alpha"]
    assert catalog.find("gamma") is None


def test_preset_only_models_with_relative_paths(tmp_path: Path) -> None:
    conf = tmp_path / "etc"
    gguf(tmp_path / "store" / "coder-7b.Q4_K_M.gguf")
    hf_dir(tmp_path / "store" / "qwen3-hf")
    gguf(tmp_path / "store" / "one-gguf" / "weights.gguf")
    conf.mkdir()
    preset = conf / "models.ini"
    preset.write_text("""\
[coder]
model = ../store/coder-7b.Q4_K_M.gguf
[qwen]
model = ../store/qwen3-hf
[single]
model = ../store/one-gguf
""")
    catalog = router(preset=preset)
    assert list(catalog.entries) == ["coder", "qwen", "single"]
    coder, qwen, single = catalog.entries.values()
    assert (coder.path.resolve(), coder.format) == ((tmp_path / "store" / "coder-7b.Q4_K_M.gguf").resolve(), "gguf")
    assert (qwen.path.resolve(), qwen.format) == ((tmp_path / "store" / "qwen3-hf").resolve(), "hf")
    assert single.path.resolve() == (tmp_path / "store" / "one-gguf" / "weights.gguf").resolve()


def test_a_relative_preset_path_from_another_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf(tmp_path / "etc" / "m.gguf")
    write_preset(tmp_path / "etc", "[m]\nmodel = m.gguf\n")
    monkeypatch.chdir(tmp_path)
    catalog = router(preset=Path("etc/models.ini"))
    assert catalog.entries["m"].path == tmp_path / "etc" / "m.gguf"
    assert catalog.entries["m"].path.is_absolute()


def test_a_section_with_a_path_replaces_the_directory_model_of_that_name(
        tmp_path: Path, models_dir: Path) -> None:
    other = gguf(tmp_path / "elsewhere" / "alpha-v2.gguf")
    preset = write_preset(tmp_path, f"[alpha]\nmodel = {other}\n")
    catalog = router(models_dir, preset)
    assert catalog.entries["alpha"].path == other
    assert set(catalog.entries) == {"alpha", "beta"}


def test_models_dir_and_preset_models_together(tmp_path: Path, models_dir: Path) -> None:
    gguf(tmp_path / "extra.gguf")
    preset = write_preset(tmp_path, "[*]\nthreads = 3\n[extra]\nmodel = extra.gguf\n")
    catalog = router(models_dir, preset)
    assert list(catalog.entries) == ["alpha", "beta", "extra"]
    assert {s.engine.threads for s in (settings(catalog, m) for m in catalog.entries)} == {3}


def test_a_section_without_a_path_must_name_a_models_dir_model(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[alpha]\ntemp = 0\n\n[gamma]\ntemp = 1\n")
    with pytest.raises(PresetError) as caught:
        router(models_dir, preset)
    assert str(caught.value) == (f"{preset}:4: section [gamma] has no 'model = PATH' "
                                 "and names no model in --models-dir")


def test_a_section_without_a_path_and_no_models_dir(tmp_path: Path) -> None:
    preset = write_preset(tmp_path, "[gamma]\ntemp = 1\n")
    with pytest.raises(PresetError, match=r":1: section \[gamma\] .* \(no --models-dir given\)"):
        router(preset=preset)


def test_a_model_path_that_is_not_a_model_points_at_its_line(tmp_path: Path) -> None:
    preset = write_preset(tmp_path, "[x]\ntemp = 0\nmodel = missing.gguf\n")
    with pytest.raises(PresetError) as caught:
        router(preset=preset)
    assert caught.value.line == 3
    assert caught.value.reason == f"model [x]: {tmp_path / 'missing.gguf'} does not exist"


def test_an_alias_may_not_be_another_models_id(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[alpha]\ntemp = 0\nalias = a, beta\n")
    with pytest.raises(PresetError) as caught:
        router(models_dir, preset)
    assert str(caught.value) == f"{preset}:3: alias 'beta' of model 'alpha' clashes with model 'beta'"


def test_an_alias_may_not_be_another_models_alias(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[alpha]\nalias = a\n[beta]\ntemp = 0\nalias = b, a\n")
    with pytest.raises(PresetError) as caught:
        router(models_dir, preset)
    assert str(caught.value) == f"{preset}:5: alias 'a' of model 'beta' is also an alias of model 'alpha'"


def test_an_alias_may_not_be_the_models_own_id(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[alpha]\nalias = alpha\n")
    with pytest.raises(PresetError, match=":2: alias 'alpha' of model 'alpha' is the model's own id"):
        router(models_dir, preset)


def test_an_alias_may_not_shadow_a_preset_only_model(tmp_path: Path, models_dir: Path) -> None:
    gguf(tmp_path / "c.gguf")
    preset = write_preset(tmp_path, "[alpha]\nalias = coder\n[coder]\nmodel = c.gguf\n")
    with pytest.raises(PresetError, match=":2: alias 'coder' of model 'alpha' clashes with model 'coder'"):
        router(models_dir, preset)


def test_a_combination_refused_by_the_engine_names_the_model_and_its_section(
        tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[*]\nthreads = 1\n\n[beta]\nmax-batched-tokens = 4\n")
    with pytest.raises(PresetError) as caught:
        router(models_dir, preset)
    assert caught.value.line == 4
    assert caught.value.reason.startswith(
        "model 'beta': max batched tokens (4) must be at least the max concurrency (8)")


def test_a_combination_from_star_points_at_star(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "version = 1\n[*]\nmax-concurrency = 1024\n")
    with pytest.raises(PresetError) as caught:
        router(models_dir, preset)
    assert caught.value.line == 2
    assert caught.value.reason.startswith("model 'alpha': max batched tokens (512)")
    assert caught.value.reason.endswith("(with the options of [*])")


def test_a_combination_from_the_command_line_names_the_model(models_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^model 'alpha': max batched tokens \(512\)") as caught:
        router(models_dir, **{"max-concurrency": 1024})
    assert not isinstance(caught.value, PresetError)


def test_router_aliases_come_from_the_preset_not_the_alias_flag(models_dir: Path) -> None:
    with pytest.raises(ValueError, match="--alias names a single MODEL's aliases"):
        build_catalog(ServeConfig(models_dir=models_dir, aliases=("x",)))


def test_a_bad_preset_fails_the_build(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[*]\nmax-ctx = 1\n")
    with pytest.raises(PresetError, match=r"models.ini:2: unknown option 'max-ctx'"):
        router(models_dir, preset)


def test_building_again_reads_the_files_again(tmp_path: Path, models_dir: Path) -> None:
    preset = write_preset(tmp_path, "[alpha]\ntemp = 0.1\n")
    first = router(models_dir, preset)
    assert router(models_dir, preset) == first
    preset.write_text("[alpha]\ntemp = 0.2\n")
    gguf(models_dir / "gamma.gguf")
    second = router(models_dir, preset)
    assert settings(second, "alpha").sampling.temperature == 0.2
    assert list(second.entries) == ["alpha", "beta", "gamma"]
    # The first catalog is a value: building again changed nothing in it.
    assert settings(first, "alpha").sampling.temperature == 0.1
    assert list(first.entries) == ["alpha", "beta"]


def test_the_example_preset_builds(tmp_path: Path) -> None:
    """presets/router-example.ini, in a layout where its paths exist."""
    presets = tmp_path / "presets"
    presets.mkdir()
    shutil.copy(ROOT / "presets" / "router-example.ini", presets)
    gguf(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    models_dir = tmp_path / "dir"
    gguf(models_dir / "qwen3-8b.gguf")
    gguf(models_dir / "other.gguf")
    catalog = router(models_dir, presets / "router-example.ini")
    assert list(catalog.entries) == ["other", "qwen3-8b", "smollm2-135m"]
    qwen = settings(catalog, "qwen3-8b")
    assert (qwen.device, qwen.engine.max_context, qwen.load_on_startup) == ("cuda", 32768, True)
    assert (qwen.model_suspend, qwen.suspend_weights) == (True, "host")
    smol = settings(catalog, "smollm2-135m")
    assert (smol.device, smol.sampling.temperature, smol.model_suspend) == ("cpu", 0.0, False)
    assert catalog.find("smol") is catalog.entries["smollm2-135m"]
    other = settings(catalog, "other")
    assert (other.engine.max_concurrency, other.load_on_startup) == (16, False)
