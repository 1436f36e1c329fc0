"""Ids in OpenAI's style: a type prefix and a random hex tail."""

from __future__ import annotations

import uuid

RESPONSE = "resp_"
MESSAGE = "msg_"
FUNCTION_CALL = "fc_"
FUNCTION_CALL_OUTPUT = "fco_"
REASONING = "rs_"


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex
