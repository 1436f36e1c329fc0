"""`roundhouse serve`: the ServeConfig a command line builds, and exit status 1
for every start-up error."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from router import cli
from router.cli import CommandLineError, build_parser, main, parse_serve_command
from router.config import ServeConfig
from router.default_model import DEFAULT_MODEL_TEMPERATURE
from router.options import BY_NAME, ROUTER_OPTIONS

DEFAULT = Path("/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")


def parse(*args: str) -> ServeConfig:
    return parse_serve_command(["serve", *args], default_model=lambda: DEFAULT)


def test_the_e2e_command_line() -> None:
    config = parse("--models-dir", "/m", "--models-max", "1", "--threads", "1",
                   "--max-concurrency", "8", "--port", "9000")
    assert config.models_dir == Path("/m")
    assert config.models_max == 1
    assert config.port == 9000
    assert config.is_router
    assert dict(config.cli_model_options) == {"threads": 1, "max-concurrency": 8}


def test_router_defaults() -> None:
    config = parse("--models-preset", "/etc/roundhouse/models.ini")
    assert config == ServeConfig(models_preset=Path("/etc/roundhouse/models.ini"))
    assert (config.host, config.port, config.models_max, config.autoload) == ("127.0.0.1", 8080, 4, True)
    assert (config.pending_timeout_ms, config.log_level) == (60_000, "info")
    assert dict(config.cli_model_options) == {}


def test_every_router_wide_option() -> None:
    config = parse("--models-dir", "/m", "--models-preset", "p.ini", "--models-max", "0",
                   "--no-models-autoload", "--pending-timeout-ms", "5000", "--host", "0.0.0.0",
                   "--port", "1234", "--log-level", "debug")
    assert config == ServeConfig(
        host="0.0.0.0", port=1234, models_dir=Path("/m"), models_preset=Path("p.ini"),
        models_max=0, autoload=False, pending_timeout_ms=5000, log_level="debug",
    )
    assert parse("--models-dir", "/m", "--models-autoload").autoload is True


def test_only_given_per_model_options_are_kept() -> None:
    config = parse("--models-dir", "/m", "--max-context", "4096", "--temp", "0.7",
                   "--model-suspend", "--suspend-weights", "host", "--stop-timeout", "5",
                   "--kv-capacity", "65536", "--device", "cuda:0")
    assert dict(config.cli_model_options) == {
        "max-context": 4096, "temp": 0.7, "model-suspend": True, "suspend-weights": "host",
        "stop-timeout": 5.0, "kv-capacity": 65536, "device": "cuda:0",
    }
    assert parse("--models-dir", "/m", "--no-model-suspend").cli_model_options == {"model-suspend": False}


def test_a_single_model_with_aliases() -> None:
    config = parse("/models/qwen3.gguf", "--alias", "qwen, q")
    assert config.model == Path("/models/qwen3.gguf")
    assert config.aliases == ("qwen", "q")
    assert not config.is_router
    assert dict(config.cli_model_options) == {}


def test_no_model_means_the_default_model_served_greedy() -> None:
    config = parse()
    assert config.model == DEFAULT
    assert dict(config.cli_model_options) == {"temp": DEFAULT_MODEL_TEMPERATURE}
    assert DEFAULT_MODEL_TEMPERATURE == 0.0
    assert parse("--temp", "0.8", "--threads", "2").cli_model_options == {"temp": 0.8, "threads": 2}


def test_parsing_downloads_nothing_without_a_default_model_function() -> None:
    from router.default_model import default_model_path

    assert parse_serve_command(["serve"]).model == default_model_path()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-context", "abc"], "argument --max-context: expected an integer, got 'abc'"),
        (["--page-size", "3"], "argument --page-size: must be a power of two, got 3"),
        (["--top-p", "0"], "argument --top-p: must be in (0.0, 1.0], got '0'"),
        (["--suspend-weights", "ram"], "argument --suspend-weights: must be one of host, disk, got 'ram'"),
        (["--max-ctx", "5"], "unrecognized arguments: --max-ctx"),
        (["--max-conc", "4"], "unrecognized arguments: --max-conc"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--alias", "a,,b"], "argument --alias: empty name in 'a,,b'"),
        (["m.gguf", "--models-dir", "/m"], "serve one MODEL, or a --models-dir/--models-preset router, not both"),
        (["--models-dir", "/m", "--alias", "a"], "--alias is for a single MODEL"),
        (["--models-dir", "/m", "--models-max", "-1"], "--models-max must be 0 (no limit) or more"),
        (["--models-dir", "/m", "--port", "0"], "--port must be 1..65535, got 0"),
    ],
)
def test_bad_command_lines(args: list[str], message: str) -> None:
    with pytest.raises(CommandLineError) as caught:
        parse(*args)
    assert str(caught.value).startswith(message)


def test_only_serve_command_lines_parse() -> None:
    with pytest.raises(CommandLineError, match="expected a `serve` command line"):
        parse_serve_command(["fetch-default"])
    with pytest.raises(CommandLineError, match="required: command"):
        parse_serve_command([])


def test_every_router_wide_flag_is_refused_in_presets() -> None:
    """A router-wide flag added to the command line must also be refused in a preset."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = {
        opt.removeprefix("--") for action in serve._actions for opt in action.option_strings
        if opt.startswith("--")
    }
    per_model = {name for name in BY_NAME} | {f"no-{name}" for name in BY_NAME}
    assert flags - per_model - {"help", "alias"} == ROUTER_OPTIONS


def test_main_exits_1_on_a_bad_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--models-dir", "/m", "--threads", "many"]) == 1
    assert "roundhouse: error: argument --threads: expected an integer, got 'many'" in capsys.readouterr().err


def test_main_exits_1_on_a_bad_preset(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Through the real server: it builds the catalog before binding any port.
    preset = tmp_path / "models.ini"
    preset.write_text("version = 1\n[*]\n\nmax-ctx = 65536\n")
    assert main(["serve", "--models-preset", str(preset)]) == 1
    assert f"{preset}:4: unknown option 'max-ctx'" in caplog.text


def test_main_exits_1_when_the_options_do_not_fit_together(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert main(["serve", "--models-dir", str(tmp_path), "--max-concurrency", "1024"]) == 1
    assert "model 'a': max batched tokens (512) must be at least" in caplog.text


def test_main_serves_a_valid_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    served: list[ServeConfig] = []
    fake = types.ModuleType("router.server")
    fake.serve = lambda config: served.append(config) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "router.server", fake)
    assert main(["serve", "--models-dir", str(tmp_path), "--seed", "3"]) == 0
    assert served == [ServeConfig(models_dir=tmp_path, cli_model_options={"seed": 3})]


def test_main_serves_the_default_model_it_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr("router.default_model.ensure_default_model", lambda: model)
    served: list[ServeConfig] = []
    fake = types.ModuleType("router.server")
    fake.serve = lambda config: served.append(config) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "router.server", fake)
    assert main(["serve", "--port", "8181"]) == 0
    assert served == [ServeConfig(model=model, port=8181, cli_model_options={"temp": 0.0})]


def test_the_module_keeps_its_entry_point() -> None:
    assert callable(cli.main)


# ---- connections, CORS, Host, environment keys (docs/security.md, docs/serving.md) ----


def test_connection_and_browser_options() -> None:
    config = parse("--models-dir", "/m")
    assert (config.http_header_timeout_ms, config.http_body_timeout_ms,
            config.http_keepalive_timeout_ms, config.max_connections) == (10_000, 60_000, 15_000, 1024)
    assert (config.cors_origins, config.allowed_hosts, config.cors) == ((), (), False)
    config = parse("--models-dir", "/m", "--http-header-timeout-ms", "500",
                   "--http-body-timeout-ms", "700", "--http-keepalive-timeout-ms", "900",
                   "--max-connections", "3", "--allowed-host", "Box.Example.",
                   "--allowed-host", "[::1]", "--cors-origins",
                   "https://App.Example.com/, http://localhost:3000")
    assert (config.http_header_timeout_ms, config.http_body_timeout_ms,
            config.http_keepalive_timeout_ms, config.max_connections) == (500, 700, 900, 3)
    assert config.allowed_hosts == ("box.example", "::1")
    assert config.cors_origins == ("https://app.example.com", "http://localhost:3000")
    # --cors is every origin, whatever the list says.
    assert parse("--models-dir", "/m", "--cors").cors_origins == ("*",)
    assert parse("--models-dir", "/m", "--cors", "--cors-origins", "https://a.example").cors


@pytest.mark.parametrize(("args", "message"), [
    (["--allowed-host", "box.example:8080"], "argument --allowed-host: --allowed-host "
                                             "'box.example:8080': give the host without a port"),
    (["--allowed-host", "a b"], "argument --allowed-host: --allowed-host 'a b': not a host"),
    (["--cors-origins", "app.example.com"], "argument --cors-origins: --cors-origins: "
                                            "'app.example.com' is not an origin"),
    (["--cors-origins", "https://a.example/path"], "argument --cors-origins: --cors-origins: "
                                                   "'https://a.example/path' is not an origin"),
    (["--cors-origins", ","], "argument --cors-origins: --cors-origins: give at least one"),
    (["--http-header-timeout-ms", "0"], "--http-header-timeout-ms must be 1 or more"),
    (["--max-connections", "0"], "--max-connections must be 1 or more"),
])
def test_bad_connection_and_browser_options(args: list[str], message: str) -> None:
    with pytest.raises(CommandLineError) as caught:
        parse("--models-dir", "/m", *args)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize("value", ["", " ", ",,", "sk-a,", "sk-a,,sk-b"])
def test_an_environment_key_that_is_empty_refuses_startup(
        value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As `--api-key ''` is refused: a typo must not start a server without keys."""
    monkeypatch.setenv("ROUNDHOUSE_API_KEY", value)
    with pytest.raises(CommandLineError, match="ROUNDHOUSE_API_KEY"):
        parse("--models-dir", "/m")
    assert main(["serve", "--models-dir", "/m"]) == 1
    err = capsys.readouterr().err
    assert "roundhouse: error: $ROUNDHOUSE_API_KEY" in err
    assert ("holds no key" in err) if not value.strip(", ") else ("is empty" in err)


def test_environment_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROUNDHOUSE_API_KEY", " sk-a , sk-b")
    assert parse("--models-dir", "/m").api_keys_env == ("sk-a", "sk-b")
    monkeypatch.delenv("ROUNDHOUSE_API_KEY")
    assert parse("--models-dir", "/m").api_keys_env == ()
