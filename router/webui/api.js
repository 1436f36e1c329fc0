// Calls to the server. Every call carries the saved API key; a 401 asks the
// user for a key (once, however many calls got it) and tries again with it.

import { askForKey } from "./keydialog.js";
import { apiKey } from "./storage.js";

export class ApiError extends Error {
  constructor(status, message, code = "") {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }

  // "409 model_busy: model 'x' has requests in flight"
  describe() {
    const where = [this.status || "", this.code].filter(Boolean).join(" ");
    return where ? `${where}: ${this.message}` : this.message;
  }
}

// The error of a failed answer, in any of the server's shapes: OpenAI's
// {"error": {"message", "code"}}, llama.cpp's {"error": {"code": 404,
// "message", "reason"}}, Anthropic's {"error": {"type", "message"}}.
export function errorOf(status, body) {
  const error = body && typeof body === "object" ? body.error || body : {};
  const message = typeof error === "string" ? error : error.message || `HTTP ${status}`;
  const code = error.reason || (typeof error.code === "string" ? error.code : "") || error.type || "";
  return new ApiError(status, message, code);
}

async function failure(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // Not JSON (a proxy's page): the status says enough.
  }
  return errorOf(response.status, body);
}

// fetch() with the key; answers the Response when it is ok, else throws ApiError.
// A cancelled key dialog gives up with the 401.
export async function call(path, { method = "GET", body, signal } = {}) {
  for (;;) {
    const headers = {};
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
      cache: "no-store",
    });
    if (response.ok) return response;
    const error = await failure(response);
    if (response.status !== 401) throw error;
    const wrong = key ? "That key was refused. " : "";
    const given = await askForKey(`${wrong}${error.message}`);
    if (!given) throw error;
  }
}

export async function getJson(path, options) {
  return (await call(path, options)).json();
}

export async function postJson(path, body, options = {}) {
  return (await call(path, { ...options, method: "POST", body })).json();
}
