// One assistant message: the stream's chunks gathered into it, and its DOM
// (reasoning, Markdown answer, tool calls, stats) rebuilt as it grows.

import { count, milliseconds, rate } from "./format.js";
import { renderMarkdown } from "./markdown.js";

function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text) node.textContent = text;
  return node;
}

// The parts of an assistant message, rebuilt from its text as it streams.
export function fillAnswer(node, message) {
  node.dataset.state = message.state || "done";
  let body = node.querySelector(".answer");
  const opened = body?.querySelector("details")?.open;
  if (!body) {
    body = el("div", { class: "answer" });
    node.append(body);
  }
  const parts = [];
  if (message.reasoning) {
    const details = el("details", { class: "reasoning", "data-testid": "reasoning" });
    details.open = opened ?? (message.state === "streaming" && !message.content);
    const thinking = message.state === "streaming" && !message.content && !message.toolCalls?.length;
    details.append(el("summary", {}, thinking ? "Thinking…" : "Reasoning"));
    const text = el("div", { class: "reasoning-text" });
    text.append(renderMarkdown(message.reasoning));
    details.append(text);
    parts.push(details);
  }
  const content = el("div", { class: "content", "data-testid": "message-content" });
  content.append(renderMarkdown(message.content || ""));
  parts.push(content);
  for (const call of message.toolCalls || []) {
    const box = el("div", { class: "tool-call", "data-testid": "tool-call" });
    box.append(el("span", { class: "tool-label" }, "Tool call"), " ",
      el("code", { class: "tool-name" }, call.name || "(unnamed)"));
    const args = el("pre");
    args.append(el("code", {}, prettyArguments(call.arguments)));
    box.append(args);
    parts.push(box);
  }
  if (message.state === "streaming" && !message.content && !message.reasoning) {
    parts.push(el("p", { class: "waiting" }, "…"));
  }
  if (message.state === "stopped") parts.push(el("p", { class: "note" }, "Stopped."));
  if (message.state === "error") {
    parts.push(el("p", { class: "error", role: "alert" }, message.error || "The request failed."));
  }
  if (message.stats) parts.push(el("p", { class: "stats", "data-testid": "stats" }, describeStats(message.stats)));
  body.replaceChildren(...parts);
}

// One chunk of a chat completion stream into the reply.
export function absorb(reply, chunk, started) {
  const choice = chunk.choices?.[0];
  const delta = choice?.delta || {};
  if ((delta.content || delta.reasoning_content) && reply.firstTokenMs === undefined) {
    reply.firstTokenMs = performance.now() - started;
  }
  if (delta.content) reply.content += delta.content;
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  for (const part of delta.tool_calls || []) {
    const index = part.index ?? reply.toolCalls.length;
    const call = reply.toolCalls[index] || (reply.toolCalls[index] = { id: "", name: "", arguments: "" });
    if (part.id) call.id = part.id;
    if (part.function?.name) call.name += part.function.name;
    if (part.function?.arguments) call.arguments += part.function.arguments;
  }
  if (chunk.timings) reply.stats = { ...chunk.timings, client_ttft_ms: reply.firstTokenMs };
  if (choice?.finish_reason) reply.finish = choice.finish_reason;
}

function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text || "";
  }
}

// "31.0 tok/s · TTFT 60 ms · 128 tokens": llama.cpp's timings; the time to the
// first token is the prompt's processing time.
function describeStats(timings) {
  const parts = [];
  if (typeof timings.predicted_per_second === "number") parts.push(rate(timings.predicted_per_second));
  const ttft = typeof timings.prompt_ms === "number" ? timings.prompt_ms : timings.client_ttft_ms;
  if (typeof ttft === "number") parts.push(`TTFT ${milliseconds(ttft)}`);
  if (typeof timings.predicted_n === "number") parts.push(`${count(timings.predicted_n)} tokens`);
  if (typeof timings.prompt_n === "number") {
    const cached = timings.cache_n ? `, ${count(timings.cache_n)} cached` : "";
    parts.push(`prompt ${count(timings.prompt_n)}${cached}`);
  }
  return parts.join(" · ");
}
