// The models view: one row per catalog model with its state (live from the
// catalog's event stream), memory, context, requests in flight and recent
// throughput (GET /v1/load every few seconds while the view is shown), and
// the load, sleep and unload buttons a client's calls would be.

import { getJson, postJson } from "./api.js";
import { stateOf } from "./catalog.js";
import { bytes, count, rate } from "./format.js";

const POLL_MS = 2500;

function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

function field(label, testid) {
  const wrap = el("div", { class: "field" });
  wrap.append(el("span", { class: "label" }, label));
  const value = el("span", { class: "value", "data-testid": testid });
  wrap.append(value);
  return [wrap, value];
}

export class ModelsView {
  constructor(catalog) {
    this.catalog = catalog;
    this.container = document.getElementById("model-rows");
    this.hint = document.getElementById("models-hint");
    this.rows = new Map(); // model id -> its row's parts
    this.loads = new Map(); // model id -> its latest /v1/load object
    this.samples = new Map(); // model id -> {time, generated} of the poll before
    this.rates = new Map(); // model id -> tokens per second over the last poll
    this.timer = null;
    catalog.addEventListener("change", () => this.render());
  }

  show() {
    this.render();
    if (!this.timer) {
      this.poll();
      this.timer = setInterval(() => this.poll(), POLL_MS);
    }
  }

  hide() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async poll() {
    try {
      const body = await getJson("/v1/load");
      // A router answers a list; a single-model server its one object.
      const models = body.object === "list" ? body.models || [] : [body];
      const now = performance.now();
      for (const load of models) {
        const generated = load.counters?.generated_tokens ?? 0;
        const before = this.samples.get(load.model);
        if (before && generated >= before.generated && now > before.time) {
          this.rates.set(load.model, (generated - before.generated) / ((now - before.time) / 1000));
        } else {
          this.rates.delete(load.model);
        }
        this.samples.set(load.model, { time: now, generated });
        this.loads.set(load.model, load);
      }
      this.render();
    } catch (error) {
      console.warn("GET /v1/load failed:", error);
    }
  }

  row(card) {
    let row = this.rows.get(card.id);
    if (row) return row;
    const node = el("article", { class: "model-row", "data-testid": "model-row", "data-model": card.id });
    const head = el("div", { class: "model-head" });
    const name = el("h2", {}, card.id);
    const state = el("span", { class: "state", "data-testid": "model-state" });
    head.append(name, state);
    const progress = el("progress", { max: "1", "data-testid": "model-progress" });
    const error = el("p", { class: "error", "data-testid": "model-error" });
    const facts = el("div", { class: "facts" });
    const [contextField, context] = field("Context", "model-context");
    const [memoryField, memory] = field("Memory", "model-memory");
    const [inflightField, inflight] = field("In flight", "model-inflight");
    const [throughputField, throughput] = field("Throughput", "model-throughput");
    facts.append(contextField, memoryField, inflightField, throughputField);
    const buttons = el("div", { class: "buttons" });
    const actions = {};
    for (const [action, label] of [["load", "Load"], ["sleep", "Sleep"], ["unload", "Unload"]]) {
      const button = el("button", { type: "button", "data-testid": action }, label);
      button.addEventListener("click", () => this.act(card.id, action));
      buttons.append(button);
      actions[action] = button;
    }
    const actionError = el("p", { class: "error", "data-testid": "model-action-error", role: "alert" });
    actionError.hidden = true;
    node.append(head, progress, error, facts, buttons, actionError);
    row = { node, state, progress, error, context, memory, inflight, throughput, actions, actionError };
    this.rows.set(card.id, row);
    return row;
  }

  async act(id, action) {
    const row = this.rows.get(id);
    row.actionError.hidden = true;
    row.actions[action].disabled = true;
    try {
      await postJson(`/models/${action}`, { model: id });
    } catch (error) {
      row.actionError.textContent = `${action} failed: ${error.describe ? error.describe() : error.message}`;
      row.actionError.hidden = false;
    } finally {
      row.actions[action].disabled = false;
      this.render();
      this.poll();
    }
  }

  render() {
    const { catalog } = this;
    this.hint.textContent = catalog.problem
      ? `Cannot reach the server: ${catalog.problem}`
      : catalog.loaded ? "" : "Reading the catalog…";
    const seen = new Set();
    for (const card of catalog.models) {
      seen.add(card.id);
      const row = this.row(card);
      this.container.append(row.node); // keeps the catalog's order
      this.fill(row, card, this.loads.get(card.id));
    }
    for (const [id, row] of this.rows) {
      if (!seen.has(id)) {
        row.node.remove();
        this.rows.delete(id);
      }
    }
  }

  fill(row, card, load) {
    const state = stateOf(card);
    row.node.dataset.state = state;
    row.state.textContent = state;
    const loading = state === "loading";
    row.progress.hidden = !loading;
    if (loading) row.progress.value = card.status.progress?.value ?? 0;
    row.error.hidden = state !== "failed";
    if (state === "failed") {
      const code = card.status.exit_code !== undefined ? ` (exit code ${card.status.exit_code})` : "";
      row.error.textContent = `${card.status.error || "the engine failed"}${code}`;
    }
    const context = load?.capacity?.max_context ?? card.max_model_len ?? card.meta?.n_ctx;
    row.context.textContent = context ? `${count(context)} tokens` : "known once loaded";
    row.memory.textContent = describeMemory(load?.memory || card.memory);
    const running = state === "loaded" || state === "sleeping";
    row.inflight.textContent = load ? count(load.in_flight ?? 0) : "—";
    const perSecond = this.rates.get(card.id);
    row.throughput.textContent = running && perSecond !== undefined ? rate(perSecond) : "—";
    row.actions.load.disabled = state === "loaded" || loading;
    row.actions.sleep.disabled = state !== "loaded";
    row.actions.unload.disabled = state === "unloaded" || state === "failed";
  }
}

function describeMemory(memory) {
  if (!memory) return "—";
  const parts = [memory.device || "not placed yet"];
  const held = memory.held?.footprint_bytes;
  if (held) parts.push(`holds ${bytes(held)}`);
  if (typeof memory.planned_bytes === "number") parts.push(`planned ${bytes(memory.planned_bytes)}`);
  return parts.join(" · ");
}
