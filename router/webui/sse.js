// Server-sent events read from a fetch() response, so that the request can
// carry the API key (EventSource cannot send headers) and be aborted.
// Yields the text of each event's data (its `data:` lines joined); comment
// lines (`: keep-alive`) and other fields are skipped.

export async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let newline;
      while ((newline = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, newline);
        buffer = buffer.slice(newline + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          // A blank line ends the event.
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
      }
    }
    if (data.length) yield data.join("\n");
  } finally {
    reader.releaseLock();
  }
}

// Each event's data parsed as JSON; `[DONE]` ends the stream.
export async function* sseJson(response) {
  for await (const text of sseData(response)) {
    if (text === "[DONE]") return;
    try {
      yield JSON.parse(text);
    } catch {
      console.warn("skipped an event that is not JSON:", text);
    }
  }
}
