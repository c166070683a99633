// How a message is drawn: its text (markdown for replies), its buttons, the versions kept
// by Regenerate and Edit (‹ 1/2 ›), the samples of an n > 1 reply, its measured stats.
"use strict";

import { enhance, renderMarkdown } from "./markdown.js";
import { siblings } from "./store.js";

export function button(label, onClick, cls = "") {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const was = btn.textContent;
  btn.textContent = "copied";
  setTimeout(() => { btn.textContent = was; }, 1200);
}

function statsText(msg) {
  const st = msg.stats;
  if (!st) return msg.pending ? "waiting for the first token…" : "";
  const parts = [];
  if (st.tokens !== null) parts.push(`${st.tokens} tokens`);
  if (st.tps !== null) parts.push(`${st.live ? "~" : ""}${st.tps.toFixed(1)} tok/s`);
  if (st.ttft_ms !== null) parts.push(`first token ${Math.round(st.ttft_ms)} ms`);
  if (st.finish_reason) parts.push(st.finish_reason === "abort" ? "stopped" : st.finish_reason);
  return parts.join(" · ");
}

function fillUser(el, conv, msg, ui) {
  if (ui.editing() === msg.id) {
    const area = Object.assign(document.createElement("textarea"), { value: msg.content, rows: 3, className: "edit" });
    const save = button("Save & send", () => ui.saveEdit(conv, msg, area.value), "primary");
    el.append(area, actions(button("Cancel", () => ui.cancelEdit()), save));
    setTimeout(() => area.focus());
    return;
  }
  const body = Object.assign(document.createElement("div"), { className: "body", textContent: msg.content });
  el.append(body, actions(
    ...branchNav(conv, msg, ui),
    button("Edit", () => ui.startEdit(msg), "edit-btn"),
    button("Copy", (ev) => copyText(msg.content, ev.currentTarget), "copy-btn"),
  ));
}

function fillAssistant(el, conv, msg, ui) {
  if (msg.choices && msg.choices.length > 1) {
    const tabs = Object.assign(document.createElement("div"), { className: "choices" });
    msg.choices.forEach((_, i) => {
      const b = button(`${i + 1}`, () => ui.chooseSample(msg, i));
      b.classList.toggle("chosen", i === (msg.chosen || 0));
      b.title = "show sample " + (i + 1) + " (the one shown goes into the history)";
      tabs.appendChild(b);
    });
    el.appendChild(tabs);
  }
  const body = Object.assign(document.createElement("div"), { className: "body markdown" });
  body.innerHTML = renderMarkdown(msg.content || "");
  enhance(body);
  for (const pre of body.querySelectorAll("pre")) {
    pre.prepend(button("copy", (ev) => copyText(pre.querySelector("code").textContent, ev.currentTarget), "code-copy"));
  }
  el.appendChild(body);
  if (msg.error) el.appendChild(Object.assign(document.createElement("div"), { className: "error-text", textContent: msg.error }));
  const stats = Object.assign(document.createElement("span"), { className: "stats", textContent: statsText(msg) });
  if (msg.stats && msg.stats.tps !== null && !msg.stats.live) stats.dataset.tps = msg.stats.tps.toFixed(2);
  const last = conv.messages[conv.messages.length - 1] === msg;
  const buttons = [stats, ...branchNav(conv, msg, ui)];
  if (!msg.pending) {
    if (msg.content) buttons.push(button("Copy", (ev) => copyText(msg.content, ev.currentTarget), "copy-btn"));
    if (last && msg.stats && msg.stats.finish_reason === "length" && !msg.choices) {
      buttons.push(button("Continue", () => ui.continueReply(conv, msg), "continue-btn"));
    }
    buttons.push(button(msg.failed ? "Retry" : "Regenerate", () => ui.regenerate(conv, msg), "regen-btn"));
  }
  el.appendChild(actions(...buttons));
}

// ‹ 2/3 ›: the versions of a message kept by Regenerate and Edit.
function branchNav(conv, msg, ui) {
  const all = siblings(conv, msg);
  if (all.length < 2) return [];
  const i = all.indexOf(msg);
  const go = (j) => { if (all[j]) ui.showVersion(conv, all[j]); };
  const prev = button("‹", () => go(i - 1), "branch-prev");
  const next = button("›", () => go(i + 1), "branch-next");
  prev.disabled = i === 0;
  next.disabled = i === all.length - 1;
  prev.title = next.title = "other versions of this message (kept by Regenerate and Edit)";
  const label = Object.assign(document.createElement("span"), { className: "branch-label", textContent: `${i + 1}/${all.length}` });
  const nav = Object.assign(document.createElement("span"), { className: "branches" });
  nav.append(prev, label, next);
  return [nav];
}

function actions(...children) {
  const div = Object.assign(document.createElement("div"), { className: "actions" });
  div.append(...children);
  return div;
}

// One message of the conversation; what its buttons do is `ui`'s (app.js).
export function messageEl(conv, msg, ui) {
  const el = document.createElement("div");
  el.className = `msg ${msg.role}` + (msg.failed ? " failed" : "") + (msg.pending ? " pending" : "");
  el.dataset.id = msg.id;
  (msg.role === "user" ? fillUser : fillAssistant)(el, conv, msg, ui);
  return el;
}
