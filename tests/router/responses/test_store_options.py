"""`roundhouse serve --response-store-max-records/--response-store-max-mib`."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import CommandLineError, parse_serve_command
from router.config import ServeConfig


def parse(*args: str) -> ServeConfig:
    return parse_serve_command(["serve", "--models-dir", "/m", *args], default_model=lambda: Path("/x"))


def test_defaults_and_given_values() -> None:
    default = parse()
    assert (default.response_store_max_records, default.response_store_max_mib) == (10_000, 512.0)
    given = parse("--response-store-max-records", "5", "--response-store-max-mib", "0.5")
    assert (given.response_store_max_records, given.response_store_max_mib) == (5, 0.5)


@pytest.mark.parametrize("args", [("--response-store-max-records", "0"), ("--response-store-max-mib", "0"),
                                  ("--response-store-max-mib", "-1")])
def test_a_store_without_room_is_refused(args: tuple[str, str]) -> None:
    with pytest.raises(CommandLineError, match="response-store"):
        parse(*args)
