// Markdown for model output, safe by construction: every character of the source is
// HTML-escaped first, and only then are the few formatting rules applied to the escaped
// text. The rules emit fixed tags (and an href that must start with http(s)://), so no
// model output can ever become markup of its own.
"use strict";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Placeholders for spans already formatted (code); \u0000 is stripped from the source first,
// so a placeholder can never be forged by the model.
const HOLD = "\u0000";

function inline(escaped) {
  const held = [];
  const hold = (html) => { held.push(html); return HOLD + (held.length - 1) + HOLD; };
  let s = escaped.replace(/`([^`\n]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
  s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/g,
    (_, label, url) => hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`));
  s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^\w*])\*([^*\n]+)\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/~~([^~\n]+)~~/g, "<del>$1</del>");
  return s.replace(new RegExp(HOLD + "(\\d+)" + HOLD, "g"), (_, i) => held[Number(i)]);
}

function blocks(escaped) {
  const out = [];
  let para = [], list = null;
  const flushPara = () => { if (para.length) out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; };
  const flushList = () => { if (list) out.push(`<${list.tag}>` + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + `</${list.tag}>`); list = null; };
  for (const line of escaped.split("\n")) {
    let m;
    if (!line.trim()) { flushPara(); flushList(); continue; }
    if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
      flushPara(); flushList();
      const level = Math.min(m[1].length + 2, 6); // h1 in a reply would shout over the page
      out.push(`<h${level}>${inline(m[2])}</h${level}>`);
    } else if ((m = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line))) {
      flushPara();
      const tag = /\d/.test(m[1]) ? "ol" : "ul";
      if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
      list.items.push(m[2]);
    } else if ((m = /^&gt;\s?(.*)$/.exec(line))) {
      flushPara(); flushList();
      out.push("<blockquote>" + inline(m[1]) + "</blockquote>");
    } else if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
      flushPara(); flushList();
      out.push("<hr>");
    } else {
      flushList();
      para.push(line);
    }
  }
  flushPara(); flushList();
  return out.join("");
}

// Fenced code blocks are cut out before anything else; a fence still open (the reply is
// streaming) runs to the end of the text.
const FENCE = /```([\w+#.-]*)[^\n]*\n?([\s\S]*?)(?:\n?```|$)/g;

export function renderMarkdown(source) {
  const text = source.replace(/\u0000/g, "");
  const out = [];
  let last = 0;
  for (const m of text.matchAll(FENCE)) {
    out.push(blocks(escapeHtml(text.slice(last, m.index))));
    const lang = m[1] ? ` data-lang="${escapeHtml(m[1])}"` : "";
    out.push(`<pre${lang}><code>${escapeHtml(m[2])}</code></pre>`);
    last = m.index + m[0].length;
  }
  out.push(blocks(escapeHtml(text.slice(last))));
  return out.join("");
}
