"""The catalog side of the lifecycle: which slot a name means, each model's
text side and sampling defaults, and the slots a catalog reload leaves.

Nothing here starts or stops an engine: router/lifecycle/reload.py asks the
manager to unload what a reload removes, then hands the fresh catalog here.
"""

from __future__ import annotations

import asyncio

from router.catalog import Catalog, load_text
from router.errors import InvalidRequest, Unavailable, model_not_found
from router.lifecycle.slot import ModelSlot, ModelState
from router.sampling import SamplingDefaults
from router.text.model_text import ModelText


class ModelRoster:
    def __init__(self, catalog: Catalog, single: bool):
        self.catalog = catalog
        self.single = single
        # One slot per catalog entry; the same dict object for the server's
        # life (reload changes its contents), so holders of it stay current.
        self.slots: dict[str, ModelSlot] = {
            entry_id: ModelSlot(entry) for entry_id, entry in catalog.entries.items()}
        self._defaults: dict[object, SamplingDefaults] = {}

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request means: its `model` (or alias), else the most
        recently used loaded model."""
        if self.single:
            # As llama.cpp's server does, a single-model server serves whatever
            # name the client sends (many send "gpt-3.5-turbo" and the like).
            return next(iter(self.slots.values()))
        if name:
            entry = self.catalog.find(name)
            if entry is None:
                raise model_not_found(name)
            return self.slots[entry.id]
        loaded = [s for s in self.slots.values() if s.state is ModelState.LOADED]
        if loaded:
            return max(loaded, key=lambda s: s.last_used)
        if len(self.slots) == 1:
            return next(iter(self.slots.values()))
        raise InvalidRequest("this server holds several models and none is loaded: name one in "
                             "'model'", code="missing_required_parameter", param="model")

    def named(self, name: str) -> ModelSlot:
        """The slot an explicit operation (load, unload, sleep) names. Unlike
        a generation request, a name that is not the model's is refused on a
        single-model server too: unloading "gpt-4" must not unload the only
        model. An empty name there still means the model."""
        if self.single:
            slot = next(iter(self.slots.values()))
            if not name or self.catalog.find(name) is not None or name == str(slot.entry.path):
                return slot
            raise model_not_found(name)
        if not name:
            raise InvalidRequest("name the model in 'model'", code="missing_required_parameter",
                                 param="model")
        entry = self.catalog.find(name)
        if entry is None:
            raise model_not_found(name)
        return self.slots[entry.id]

    async def text_for(self, slot: ModelSlot) -> ModelText:
        """Tokenizer and template, read from the model's files without loading it."""
        if slot.text is None:
            async with slot.text_lock:
                if slot.text is None:
                    try:
                        # With the model's --chat-template and --chat-template-kwargs.
                        slot.text = await asyncio.to_thread(load_text, slot.entry)
                    except (OSError, ValueError) as exc:
                        raise Unavailable(f"model '{slot.id}' has no usable tokenizer: {exc}",
                                          code="model_load_failed") from exc
        return slot.text

    def sampling_defaults(self, slot: ModelSlot) -> SamplingDefaults:
        """The model's defaults for sampling fields a request leaves out;
        keyed by its catalog entry, so a reload that changes it starts afresh."""
        entry = slot.entry
        if entry not in self._defaults:
            self._defaults[entry] = SamplingDefaults.for_model(entry.path, entry.settings.sampling)
        return self._defaults[entry]

    def diff(self, fresh: Catalog) -> dict[str, list[str]]:
        """The ids a fresh catalog adds, removes and changes."""
        old = self.catalog.entries
        return {
            "added": [i for i in fresh.entries if i not in old],
            "removed": [i for i in old if i not in fresh.entries],
            "changed": [i for i in fresh.entries if i in old and fresh.entries[i] != old[i]],
        }

    def replace(self, fresh: Catalog, summary: dict[str, list[str]]) -> list[ModelSlot]:
        """Take the fresh catalog (the removed and changed models are unloaded
        by now); returns the slots that left."""
        gone = [self.slots.pop(i) for i in summary["removed"]]
        for entry_id in summary["changed"]:
            gone.append(self.slots[entry_id])
            self.slots[entry_id] = ModelSlot(fresh.entries[entry_id])
        for entry_id in summary["added"]:
            self.slots[entry_id] = ModelSlot(fresh.entries[entry_id])
        self.catalog = fresh
        return gone
