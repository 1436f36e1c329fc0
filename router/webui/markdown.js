// Markdown to DOM nodes, for model output. Safety comes from the method:
// text only ever enters the page as text nodes (append of a string,
// textContent), never as HTML, so nothing a model writes can become markup
// or script. Links keep only absolute http(s) URLs and open with
// rel="noopener noreferrer".
//
// Covers what chat models write: headings, paragraphs, fenced code (an
// unclosed fence, mid-stream, is code to the end), inline code, bold,
// italic, strikethrough, links and bare URLs, lists (nested by indent),
// block quotes, tables and rules. Single newlines in a paragraph are kept.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const LANGUAGE = /^[\w+#.-]{1,32}$/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

export function safeUrl(text) {
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

function link(href, label) {
  const a = el("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  if (typeof label === "string") a.textContent = label;
  else inline(label.text, a);
  return a;
}

// ---- inline -------------------------------------------------------------------------

const ESCAPABLE = "\\`*_{}[]()#+-.!~|<>";
const LINK = /^\[([^\]\n]*)\]\(\s*<?([^()\s<>]+)>?(?:\s+"[^"\n]*")?\s*\)/;
const BARE_URL = /^https?:\/\/[^\s<>"'`]+/;

function isWordChar(ch) {
  return ch !== undefined && /[\p{L}\p{N}]/u.test(ch);
}

// Where the closing `marker` of an emphasis opened at `from` is, or -1.
function closing(text, from, marker) {
  let at = text.indexOf(marker, from);
  while (at >= 0) {
    const before = text[at - 1];
    const after = text[at + marker.length];
    const flanked = before !== undefined && !/\s/.test(before);
    const wordy = marker[0] === "_" && isWordChar(after);
    if (at > from && flanked && !wordy && text[at + marker.length] !== marker[0]) return at;
    at = text.indexOf(marker, at + 1);
  }
  return -1;
}

export function inline(text, parent) {
  let plain = "";
  const flush = () => {
    if (plain) parent.append(plain);
    plain = "";
  };
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    const rest = text.slice(i);
    if (ch === "\\" && ESCAPABLE.includes(text[i + 1] ?? "")) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (ch === "`") {
      const run = /^`+/.exec(rest)[0];
      const end = text.indexOf(run, i + run.length);
      if (end > 0) {
        flush();
        const code = el("code");
        code.textContent = text.slice(i + run.length, end).replace(/^ (.+) $/, "$1");
        parent.append(code);
        i = end + run.length;
        continue;
      }
      plain += run;
      i += run.length;
      continue;
    }
    if (ch === "[") {
      const match = LINK.exec(rest);
      const href = match && safeUrl(match[2]);
      if (href) {
        flush();
        parent.append(link(href, { text: match[1] || href }));
        i += match[0].length;
        continue;
      }
    }
    if ((ch === "h" || ch === "<") && !isWordChar(text[i - 1])) {
      const angled = ch === "<" ? /^<(https?:\/\/[^\s<>]+)>/.exec(rest) : null;
      const bare = ch === "h" ? BARE_URL.exec(rest) : null;
      if (angled || bare) {
        // Trailing punctuation ends the sentence, not the URL.
        const url = angled ? angled[1] : bare[0].replace(/[.,;:!?)\]]+$/, "");
        const href = safeUrl(url);
        if (href) {
          flush();
          parent.append(link(href, url));
          i += angled ? angled[0].length : url.length;
          continue;
        }
      }
    }
    if (ch === "*" || ch === "_" || ch === "~") {
      const marker = /^([*_~])\1?/.exec(rest)[0];
      const opensWord = ch !== "_" || !isWordChar(text[i - 1]);
      const next = text[i + marker.length];
      if ((ch !== "~" || marker.length === 2) && opensWord && next && !/\s/.test(next)) {
        const end = closing(text, i + marker.length, marker);
        if (end > 0) {
          flush();
          const tag = ch === "~" ? "del" : marker.length === 2 ? "strong" : "em";
          const node = el(tag);
          inline(text.slice(i + marker.length, end), node);
          parent.append(node);
          i = end + marker.length;
          continue;
        }
      }
      plain += marker;
      i += marker.length;
      continue;
    }
    if (ch === "\n") {
      flush();
      parent.append(el("br"));
      i += 1;
      continue;
    }
    plain += ch;
    i += 1;
  }
  flush();
}

// ---- blocks -------------------------------------------------------------------------

function codeBlock(lines, language) {
  const wrap = el("div", "code-block");
  const bar = el("div", "code-bar");
  const label = el("span", "code-language");
  label.textContent = LANGUAGE.test(language) ? language : "";
  const copy = el("button", "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  const pre = el("pre");
  const code = el("code");
  if (LANGUAGE.test(language)) code.className = `language-${language}`;
  code.textContent = lines.join("\n");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code.textContent);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  bar.append(label, copy);
  pre.append(code);
  wrap.append(bar, pre);
  return wrap;
}

function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim());
}

function table(head, rows) {
  const wrap = el("div", "table-wrap");
  const node = el("table");
  const thead = el("thead");
  const tr = el("tr");
  for (const cell of cells(head)) {
    const th = el("th");
    inline(cell, th);
    tr.append(th);
  }
  thead.append(tr);
  const tbody = el("tbody");
  for (const row of rows) {
    const line = el("tr");
    for (const cell of cells(row)) {
      const td = el("td");
      inline(cell, td);
      line.append(td);
    }
    tbody.append(line);
  }
  node.append(thead, tbody);
  wrap.append(node);
  return wrap;
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line) || (line.includes("|") && next !== undefined && TABLE_RULE.test(next));
}

function indentOf(line) {
  return /^\s*/.exec(line)[0].length;
}

// A list starting at lines[start]: its items, each with the lines of its body.
function list(lines, start) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  let body = null;
  const items = [];
  while (i < lines.length) {
    const line = lines[i];
    const item = ITEM.exec(line);
    if (item && item[1].length === indent && /\d/.test(item[2]) === ordered) {
      body = [item[3]];
      items.push(body);
    } else if (line.trim() === "") {
      // A blank line inside a list goes on only if the list does.
      const next = lines[i + 1];
      if (next === undefined || (indentOf(next) <= indent && !ITEM.test(next))) break;
      body.push("");
    } else if (indentOf(line) > indent) {
      body.push(line.slice(Math.min(indentOf(line), indent + 4)));
    } else if (!startsBlock(line, lines[i + 1]) && body[body.length - 1] !== "") {
      body.push(line.trim()); // a lazy continuation of the item's paragraph
    } else {
      break;
    }
    i += 1;
  }
  for (const itemLines of items) {
    const li = el("li");
    const content = blocks(itemLines);
    // A one-paragraph item needs no <p>.
    if (content.childNodes.length === 1 && content.firstChild.tagName === "P") {
      li.append(...content.firstChild.childNodes);
    } else {
      li.append(content);
    }
    node.append(li);
  }
  return [node, i];
}

function blocks(lines) {
  const out = document.createDocumentFragment();
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.trim() === "") {
      i += 1;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      const marker = fence[1];
      const code = [];
      i += 1;
      while (i < lines.length) {
        const close = lines[i].trim();
        if (close.startsWith(marker) && /^([`~])\1*$/.test(close) && close[0] === marker[0]) break;
        code.push(lines[i]);
        i += 1;
      }
      out.append(codeBlock(code, fence[2]));
      i += 1;
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const node = el(`h${heading[1].length}`);
      inline(heading[2], node);
      out.append(node);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.append(el("hr"));
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) {
        quoted.push(QUOTE.exec(lines[i])[1]);
        i += 1;
      }
      const node = el("blockquote");
      node.append(blocks(quoted));
      out.append(node);
      continue;
    }
    if (ITEM.test(line)) {
      const [node, next] = list(lines, i);
      out.append(node);
      i = next;
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      const rows = [];
      let j = i + 2;
      while (j < lines.length && lines[j].includes("|") && lines[j].trim() !== "") {
        rows.push(lines[j]);
        j += 1;
      }
      out.append(table(line, rows));
      i = j;
      continue;
    }
    const paragraph = [line.trim()];
    i += 1;
    while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i], lines[i + 1])) {
      paragraph.push(lines[i].trim());
      i += 1;
    }
    const node = el("p");
    inline(paragraph.join("\n"), node);
    out.append(node);
  }
  return out;
}

// The rendered Markdown of `text`, as a DocumentFragment.
export function renderMarkdown(text) {
  return blocks(String(text).replace(/\r\n?/g, "\n").split("\n"));
}
