// The chat page's helpers around the conversation: the connection line in the header, the
// notice line, export / import of conversations, text attachments and the colour theme.
"use strict";

import { authHeaders } from "./transport.js";

// A line above the conversation for what the page must say (an import, a full storage).
export function noticeIn(el) {
  return (text) => {
    el.textContent = text;
    el.hidden = !text;
  };
}

// The header says what is known: connected, or why not (the server is unreachable, or it
// wants an API key: asked of /v1/models) with a live countdown to the next attempt.
// `changed` runs on every change (the page turns Send off while disconnected).
export function statusIn(el, apiKey, changed) {
  let timer = 0, why = "";
  return (state, text, retryAt) => {
    clearInterval(timer);
    el.dataset.state = state;
    changed();
    if (state !== "disconnected") { el.textContent = text; why = ""; return; }
    const draw = () => {
      const secs = Math.max(0, Math.ceil((retryAt - Date.now()) / 1000));
      el.textContent = `${why || "server unreachable"} · retrying in ${secs} s`;
    };
    draw();
    timer = setInterval(draw, 500);
    fetch("/v1/models", { headers: authHeaders(apiKey()) }).then((r) => {
      why = r.status === 401 ? "the server needs an API key (Settings)" : r.ok ? "chat socket closed" : `server error ${r.status}`;
    }, () => { why = "server unreachable"; }).finally(draw);
  };
}

// A button that opens a hidden file input, and what to do with the file chosen.
export function onFile(button, input, use) {
  button.addEventListener("click", () => input.click());
  input.addEventListener("change", () => {
    const file = input.files[0];
    input.value = ""; // the same file can be chosen again
    if (file) use(file);
  });
}

// -- export / import -------------------------------------------------------------------
export function exportConversations(store) {
  const blob = new Blob([store.exportJSON()], { type: "application/json" });
  const a = Object.assign(document.createElement("a"), {
    href: URL.createObjectURL(blob), download: `streamkv-chats-${new Date().toISOString().slice(0, 10)}.json` });
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
}

export async function importConversations(store, file, notice) {
  try {
    const n = store.importJSON(await file.text());
    notice(`imported ${n} conversation${n > 1 ? "s" : ""} from ${file.name}`);
  } catch (e) {
    notice(`could not import ${file.name}: ${e.message}`);
  }
}

// -- attachments -----------------------------------------------------------------------
// A text file goes into the message as a fenced block (the model reads text only).
const MAX_ATTACH_BYTES = 200_000;

export async function attachText(input, file, notice) {
  if (file.size > MAX_ATTACH_BYTES) {
    return notice(`${file.name} is ${Math.round(file.size / 1000)} kB: attach at most ${MAX_ATTACH_BYTES / 1000} kB of text`);
  }
  const text = await file.text();
  if (text.includes("\u0000")) return notice(`${file.name} is not a text file`);
  const fence = text.includes("```") ? "````" : "```";
  input.value = `${input.value}${input.value ? "\n\n" : ""}${file.name}:\n${fence}\n${text.replace(/\n$/, "")}\n${fence}\n`;
  notice("");
  input.focus();
}

// -- theme -----------------------------------------------------------------------------
// auto follows the OS (prefers-color-scheme); the button cycles auto → dark → light.
const THEMES = ["auto", "dark", "light"];
const LABELS = { auto: "◐ auto", dark: "☾ dark", light: "☀ light" };

export function themeToggle(button) {
  const set = (theme) => {
    document.documentElement.dataset.theme = theme;
    localStorage.setItem("streamkv.theme", theme);
    button.textContent = LABELS[theme];
    button.title = `colour theme: ${theme} (click to change)`;
  };
  button.addEventListener("click", () => {
    const now = document.documentElement.dataset.theme || "auto";
    set(THEMES[(THEMES.indexOf(now) + 1) % THEMES.length]);
  });
  const saved = localStorage.getItem("streamkv.theme");
  set(THEMES.includes(saved) ? saved : "auto");
}
