"""Model lifecycles: the state machine, the manager that drives it, and the
events it publishes (GET /models/sse)."""

from router.lifecycle.events import ModelEvents
from router.lifecycle.manager import ModelManager
from router.lifecycle.slot import ModelSlot, ModelState

__all__ = ["ModelEvents", "ModelManager", "ModelSlot", "ModelState"]
