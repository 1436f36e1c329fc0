// The chat view: a model picker (loading the picked model when it is not
// loaded), streamed answers with reasoning and tool calls, Stop, edit and
// regenerate, settings, and the conversations kept in localStorage.

import { ApiError, call, postJson } from "./api.js";
import { stateOf } from "./catalog.js";
import { absorb, fillAnswer } from "./message.js";
import { sseJson } from "./sse.js";
import * as storage from "./storage.js";

const TITLE_CHARS = 48;

function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
}

function testid(name) {
  return document.querySelector(`[data-testid=${name}]`);
}

export class ChatView {
  constructor(catalog) {
    this.catalog = catalog;
    this.conversations = storage.conversations();
    this.current = null; // the open conversation; null until a first message
    this.generation = null; // {controller, reply} while an answer streams
    this.pendingLoad = ""; // a model this page asked to load, until it is loaded
    this.loadError = "";
    this.settings = storage.settings();

    this.select = testid("model-select");
    this.input = testid("chat-input");
    this.sendButton = testid("send");
    this.stopButton = testid("stop");
    this.messages = testid("messages");
    this.list = testid("conversations");
    this.progress = testid("load-progress");
    this.system = testid("system-prompt");
    this.temperature = testid("temperature");
    this.maxTokens = testid("max-tokens");

    this.system.value = this.settings.system;
    this.temperature.value = this.settings.temperature;
    this.maxTokens.value = this.settings.maxTokens;
    for (const input of [this.system, this.temperature, this.maxTokens]) {
      input.addEventListener("change", () => this.saveSettings());
    }
    document.getElementById("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
    testid("new-chat").addEventListener("click", () => this.open(null));
    this.select.addEventListener("change", () => this.pick(this.select.value));
    const toggle = document.getElementById("sidebar-toggle");
    toggle.addEventListener("click", () => {
      const open = document.getElementById("sidebar").classList.toggle("open");
      toggle.setAttribute("aria-expanded", String(open));
    });
    catalog.addEventListener("change", () => this.renderModels());

    this.renderList();
    this.renderMessages();
    this.setBusy(false);
  }

  // ---- settings and models ------------------------------------------------------

  saveSettings() {
    this.settings = {
      ...this.settings,
      system: this.system.value,
      temperature: this.temperature.value.trim(),
      maxTokens: this.maxTokens.value.trim(),
    };
    storage.saveSettings(this.settings);
  }

  renderModels() {
    const { models } = this.catalog;
    const wanted = this.select.value || this.current?.model || this.settings.model;
    const options = models.map((card) => {
      const option = el("option", { value: card.id }, `${card.id} (${stateOf(card)})`);
      option.dataset.state = stateOf(card);
      return option;
    });
    this.select.replaceChildren(...options);
    if (models.some((card) => card.id === wanted)) this.select.value = wanted;
    else if (models.length) {
      // The loaded model, else the first: what a request naming none would use.
      const loaded = models.find((card) => stateOf(card) === "loaded");
      this.select.value = (loaded || models[0]).id;
    }
    this.renderProgress();
  }

  // Picking a model that is not loaded loads it, so the first answer comes sooner.
  async pick(id) {
    this.settings = { ...this.settings, model: id };
    storage.saveSettings(this.settings);
    if (this.current) {
      this.current.model = id;
      this.save();
    }
    const card = this.catalog.find(id);
    this.loadError = "";
    if (card && stateOf(card) !== "loaded") {
      this.pendingLoad = id;
      this.renderProgress();
      try {
        await postJson("/models/load", { model: id });
      } catch (error) {
        this.loadError = error.describe ? error.describe() : error.message;
        this.pendingLoad = "";
      }
    }
    this.renderProgress();
  }

  renderProgress() {
    const card = this.catalog.find(this.select.value);
    const state = card ? stateOf(card) : "";
    if (card && this.pendingLoad === card.id && (state === "loaded" || state === "failed")) {
      this.pendingLoad = "";
    }
    const bar = this.progress.querySelector("progress");
    const text = this.progress.querySelector(".load-text");
    const loading = state === "loading" || (card && this.pendingLoad === card.id);
    if (this.loadError) {
      this.progress.hidden = false;
      bar.hidden = true;
      text.textContent = `Load failed: ${this.loadError}`;
    } else if (loading) {
      const value = card.status?.progress?.value ?? 0;
      this.progress.hidden = false;
      bar.hidden = false;
      bar.value = value;
      text.textContent = `Loading ${card.id}… ${Math.round(value * 100)}%`;
    } else if (state === "failed") {
      this.progress.hidden = false;
      bar.hidden = true;
      text.textContent = `${card.id} failed to load: ${card.status.error || "see the server log"}`;
    } else {
      this.progress.hidden = true;
    }
  }

  // ---- conversations --------------------------------------------------------------

  save() {
    if (this.current) this.current.updated = Date.now();
    storage.saveConversations(this.conversations);
    this.renderList();
  }

  open(conversation) {
    if (this.generation) this.stop();
    this.current = conversation;
    if (conversation?.model && this.catalog.find(conversation.model)) {
      this.select.value = conversation.model;
      this.renderProgress();
    }
    this.renderList();
    this.renderMessages();
    document.getElementById("sidebar").classList.remove("open");
    this.input.focus();
  }

  remove(conversation) {
    if (this.current === conversation) this.open(null);
    this.conversations = this.conversations.filter((c) => c !== conversation);
    this.save();
  }

  renderList() {
    const sorted = [...this.conversations].sort((a, b) => (b.updated || 0) - (a.updated || 0));
    this.list.replaceChildren(...sorted.map((conversation) => {
      const item = el("li", { "data-testid": "conversation" });
      if (conversation === this.current) item.setAttribute("aria-current", "true");
      const openButton = el("button", { type: "button", class: "conversation-title" },
        conversation.title || "Untitled");
      openButton.addEventListener("click", () => this.open(conversation));
      const removeButton = el("button", {
        type: "button", class: "icon", "data-testid": "delete-conversation",
        "aria-label": `Delete ${conversation.title || "conversation"}`, title: "Delete",
      }, "✕");
      removeButton.addEventListener("click", () => this.remove(conversation));
      item.append(openButton, removeButton);
      return item;
    }));
  }

  // ---- messages -------------------------------------------------------------------

  renderMessages() {
    const messages = this.current?.messages || [];
    this.messages.replaceChildren(...messages.map((message, index) => this.messageNode(message, index)));
    if (!messages.length) {
      this.messages.append(el("p", { class: "empty" }, "Ask something to start a conversation."));
    }
    this.scrollDown();
  }

  scrollDown() {
    this.messages.scrollTop = this.messages.scrollHeight;
  }

  messageNode(message, index) {
    const node = el("article", { class: `message ${message.role}`, "data-testid": "message",
      "data-role": message.role });
    const head = el("div", { class: "message-head" });
    head.append(el("span", { class: "role" }, message.role === "user" ? "You" : message.model || "Assistant"));
    const buttons = el("span", { class: "message-buttons" });
    head.append(buttons);
    node.append(head);
    if (message.role === "user") {
      node.append(el("div", { class: "user-text", "data-testid": "message-content" }, message.content));
      const edit = el("button", { type: "button", class: "small", "data-testid": "edit" }, "Edit");
      edit.addEventListener("click", () => this.edit(index));
      buttons.append(edit);
      return node;
    }
    node.dataset.state = message.state || "done";
    fillAnswer(node, message);
    const last = index === this.current.messages.length - 1;
    if (last && message.state !== "streaming") {
      const again = el("button", { type: "button", class: "small", "data-testid": "regenerate" }, "Regenerate");
      again.addEventListener("click", () => this.regenerate());
      buttons.append(again);
    }
    return node;
  }

  setBusy(busy) {
    this.stopButton.hidden = !busy;
    this.stopButton.disabled = !busy;
    this.sendButton.disabled = busy;
  }

  // ---- sending ------------------------------------------------------------------

  send() {
    const text = this.input.value.trim();
    if (!text || this.generation) return;
    if (!this.select.value) {
      this.input.setCustomValidity("No model to send to yet.");
      this.input.reportValidity();
      return;
    }
    this.input.setCustomValidity("");
    if (!this.current) {
      this.current = { id: newId(), title: text.slice(0, TITLE_CHARS), model: this.select.value,
        messages: [], updated: Date.now() };
      this.conversations.push(this.current);
    }
    this.current.messages.push({ role: "user", content: text });
    this.input.value = "";
    this.generate(this.current);
  }

  stop() {
    this.generation?.controller.abort();
  }

  edit(index) {
    if (this.generation) this.stop();
    const message = this.current.messages[index];
    this.input.value = message.content;
    this.current.messages.splice(index);
    this.save();
    this.renderMessages();
    this.input.focus();
  }

  regenerate() {
    if (this.generation) return;
    const messages = this.current.messages;
    if (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
    this.generate(this.current);
  }

  request(conversation) {
    const messages = [];
    const system = this.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const message of conversation.messages) {
      if (message.role === "user") messages.push({ role: "user", content: message.content });
      // An answer that failed before it said anything is not part of the conversation.
      else if (message.content) messages.push({ role: "assistant", content: message.content });
    }
    const body = { model: this.select.value, messages, stream: true, timings_per_token: true };
    const temperature = parseFloat(this.temperature.value);
    if (Number.isFinite(temperature)) body.temperature = temperature;
    const maxTokens = parseInt(this.maxTokens.value, 10);
    if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    return body;
  }

  async generate(conversation) {
    const body = this.request(conversation);
    const reply = { role: "assistant", model: body.model, content: "", reasoning: "", toolCalls: [],
      state: "streaming" };
    conversation.messages.push(reply);
    conversation.model = body.model;
    this.save();
    this.renderMessages();
    const node = this.messages.lastElementChild;
    const controller = new AbortController();
    this.generation = { controller, reply };
    this.setBusy(true);
    const started = performance.now();
    let frame = 0;
    const update = () => {
      frame = 0;
      fillAnswer(node, reply);
      this.scrollDown();
    };
    try {
      const response = await call("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
      for await (const chunk of sseJson(response)) {
        if (chunk.error) {
          const { message, code, reason, type } = chunk.error;
          throw new ApiError(0, message || "the stream failed", reason || code || type || "");
        }
        absorb(reply, chunk, started);
        if (!frame) frame = requestAnimationFrame(update);
      }
      reply.state = "done";
    } catch (error) {
      if (error.name === "AbortError") reply.state = "stopped";
      else {
        reply.state = "error";
        reply.error = error.describe ? error.describe() : String(error.message || error);
      }
    } finally {
      if (frame) cancelAnimationFrame(frame);
      this.generation = null;
      this.setBusy(false);
      this.save();
      if (this.current === conversation) this.renderMessages();
    }
  }
}
