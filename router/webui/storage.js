// What the page keeps in this browser (localStorage): the API key, the
// conversations and the chat settings. A full or disabled storage must not
// break the page, so every write is best effort.

const KEY = "roundhouse.apiKey";
const CONVERSATIONS = "roundhouse.conversations";
const SETTINGS = "roundhouse.settings";

function read(name, fallback) {
  try {
    const text = localStorage.getItem(name);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

function write(name, value) {
  try {
    localStorage.setItem(name, JSON.stringify(value));
  } catch (error) {
    console.warn(`could not save ${name}:`, error);
  }
}

export function apiKey() {
  try {
    return localStorage.getItem(KEY) || "";
  } catch {
    return "";
  }
}

export function saveApiKey(key) {
  try {
    localStorage.setItem(KEY, key);
  } catch (error) {
    console.warn("could not save the API key:", error);
  }
}

// [{id, title, model, updated, messages: [{role, content, reasoning, toolCalls, stats, state}]}]
export function conversations() {
  const list = read(CONVERSATIONS, []);
  return Array.isArray(list) ? list.filter((c) => c && typeof c.id === "string") : [];
}

export function saveConversations(list) {
  write(CONVERSATIONS, list);
}

export function settings() {
  const value = read(SETTINGS, {});
  return {
    system: typeof value.system === "string" ? value.system : "",
    temperature: typeof value.temperature === "string" ? value.temperature : "",
    maxTokens: typeof value.maxTokens === "string" ? value.maxTokens : "",
    model: typeof value.model === "string" ? value.model : "",
  };
}

export function saveSettings(value) {
  write(SETTINGS, value);
}
