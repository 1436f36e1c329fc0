// The models and their states, shared by both views: GET /models once, then
// kept current by GET /models/sse (never by polling /models). When the event
// stream drops, it is read again after a fresh GET /models, since events may
// have been missed meanwhile.
//
// Events name a model by its catalog name (the card's `name`); cards are
// shown and requested by `id` (an alias on a single-model server).

import { call, getJson } from "./api.js";
import { sseJson } from "./sse.js";

const RETRY_MS = [1000, 2000, 5000, 10000];

export function stateOf(card) {
  return card.status?.failed ? "failed" : card.status?.value || "unloaded";
}

export class Catalog extends EventTarget {
  constructor() {
    super();
    this.models = [];
    this.loaded = false; // the first GET /models answered
    this.problem = ""; // why the catalog cannot be read now
    this.live = false; // the event stream is open
  }

  find(id) {
    return this.models.find((card) => card.id === id);
  }

  changed() {
    this.dispatchEvent(new Event("change"));
  }

  async refresh() {
    const body = await getJson("/models");
    this.models = Array.isArray(body.data) ? body.data : [];
    this.loaded = true;
    this.problem = "";
    this.changed();
  }

  // Runs for the page's life: the catalog, then its events, again on a drop.
  async watch() {
    let failures = 0;
    for (;;) {
      try {
        await this.refresh();
        const response = await call("/models/sse");
        this.live = true;
        failures = 0;
        this.changed();
        for await (const event of sseJson(response)) this.apply(event);
        this.problem = "the event stream ended; reconnecting";
      } catch (error) {
        this.problem = error.describe ? error.describe() : String(error.message || error);
      }
      this.live = false;
      this.changed();
      await new Promise((resolve) => setTimeout(resolve, RETRY_MS[Math.min(failures, 3)]));
      failures += 1;
    }
  }

  apply(event) {
    if (event.event === "models_reload" || event.event === "model_remove") {
      this.refresh().catch((error) => console.warn("GET /models failed:", error));
      return;
    }
    if (event.event !== "model_status" || !event.data) return;
    const card = this.models.find((c) => c.name === event.model || c.id === event.model);
    if (!card) {
      // A model this page has not seen: the catalog changed.
      this.refresh().catch((error) => console.warn("GET /models failed:", error));
      return;
    }
    const data = event.data;
    const previous = card.status || {};
    const status = { ...previous, value: data.status };
    // A failure is shown until the next load starts.
    delete status.failed;
    delete status.error;
    delete status.exit_code;
    if (data.failed) {
      status.failed = true;
      status.error = data.error;
      if (data.exit_code !== undefined) status.exit_code = data.exit_code;
    }
    if (data.status === "loading") {
      status.progress = data.progress || (previous.value === "loading" ? previous.progress : { value: 0 });
    } else {
      delete status.progress;
    }
    card.status = status;
    if (data.status === "unloaded") {
      // Its engine is gone: what it held and its context with it.
      delete card.max_model_len;
      delete card.meta;
      if (card.memory) card.memory = { ...card.memory, held: null };
    }
    this.changed();
  }
}
