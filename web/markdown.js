// Markdown for model output: GitHub-flavoured (tables, nested lists, strikethrough, fenced
// code) by markdown-it, code coloured by highlight.js, math by KaTeX. All three are vendored
// under web/vendor/ (minified, with their licences) and loaded by index.html as classic
// scripts, so the page works offline. Why these three: web/vendor/README.md.
//
// Safe by construction: markdown-it runs with html: false (every "<" in the reply is text)
// and its link validator refuses javascript:/data: URLs; KaTeX runs with trust: false.
// Math is rendered into the DOM by katex.render after the HTML is in place: the page's
// Content-Security-Policy forbids inline style attributes, which katex's HTML string has.
"use strict";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

// $…$ and \(…\) inline; $$…$$ and \[…\] as blocks. "$5 and $10" stays text: an inline $
// must not touch a space inside and must not be followed by a digit.
function mathInline(state, silent) {
  const src = state.src, start = state.pos;
  let open, close;
  if (src.startsWith("\\(", start)) { open = "\\("; close = "\\)"; }
  else if (src[start] === "$" && src[start + 1] !== "$") { open = "$"; close = "$"; }
  else return false;
  const from = start + open.length;
  if (open === "$" && (/\s/.test(src[from] || " "))) return false;
  let end = src.indexOf(close, from);
  while (end > 0 && src[end - 1] === "\\") end = src.indexOf(close, end + 1);
  if (end < 0 || end === from) return false;
  if (open === "$" && (/\s/.test(src[end - 1]) || /\d/.test(src[end + 1] || ""))) return false;
  if (!silent) {
    const token = state.push("math_inline", "span", 0);
    token.content = src.slice(from, end);
  }
  state.pos = end + close.length;
  return true;
}

function mathBlock(state, startLine, endLine, silent) {
  const first = state.src.slice(state.bMarks[startLine] + state.tShift[startLine], state.eMarks[startLine]);
  const open = first.startsWith("$$") ? "$$" : first.startsWith("\\[") ? "\\[" : null;
  if (!open) return false;
  const close = open === "$$" ? "$$" : "\\]";
  let body = first.slice(2), line = startLine, found = false;
  if (body.trimEnd().endsWith(close)) { body = body.trimEnd().slice(0, -2); found = true; }
  while (!found && ++line < endLine) {
    const text = state.src.slice(state.bMarks[line] + state.tShift[line], state.eMarks[line]);
    if (text.trimEnd().endsWith(close)) { body += "\n" + text.trimEnd().slice(0, -2); found = true; } else body += "\n" + text;
  }
  if (!found) return false; // still streaming: shown as text until it closes
  if (silent) return true;
  const token = state.push("math_block", "div", 0);
  token.content = body.trim();
  token.map = [startLine, line + 1];
  state.line = line + 1;
  return true;
}

function highlight(code, lang) {
  const hljs = globalThis.hljs;
  if (!hljs) return "";
  try {
    if (lang && hljs.getLanguage(lang)) return hljs.highlight(code, { language: lang, ignoreIllegals: true }).value;
    return code.length < 20000 ? hljs.highlightAuto(code).value : "";
  } catch {
    return "";
  }
}

let md = null;
function parser() {
  if (md || !globalThis.markdownit) return md;
  md = globalThis.markdownit({ html: false, linkify: true, typographer: false, highlight });
  md.inline.ruler.after("escape", "math_inline", mathInline);
  md.block.ruler.after("blockquote", "math_block", mathBlock, { alt: ["paragraph", "reference", "blockquote", "list"] });
  md.renderer.rules.math_inline = (tokens, i) => `<span class="math" data-tex="${escapeHtml(tokens[i].content)}"></span>`;
  md.renderer.rules.math_block = (tokens, i) => `<div class="math display" data-tex="${escapeHtml(tokens[i].content)}"></div>`;
  const link = md.renderer.rules.link_open || ((tokens, i, options, env, self) => self.renderToken(tokens, i, options));
  md.renderer.rules.link_open = (tokens, i, options, env, self) => {
    tokens[i].attrSet("target", "_blank");
    tokens[i].attrSet("rel", "noopener noreferrer");
    return link(tokens, i, options, env, self);
  };
  // A reply's headings sit under the page's own: # becomes h3.
  md.renderer.rules.heading_open = (tokens, i) => `<h${Math.min(Number(tokens[i].tag[1]) + 2, 6)}>`;
  md.renderer.rules.heading_close = (tokens, i) => `</h${Math.min(Number(tokens[i].tag[1]) + 2, 6)}>`;
  return md;
}

export function renderMarkdown(source) {
  const p = parser();
  const text = source.replace(/\u0000/g, "");
  if (!p) return `<p class="plain">${escapeHtml(text)}</p>`; // vendor scripts missing: plain text
  return p.render(text);
}

// After the HTML is in the page: math through KaTeX, language labels on code blocks.
export function enhance(root) {
  for (const node of root.querySelectorAll(".math[data-tex]")) {
    if (!globalThis.katex) { node.textContent = node.dataset.tex; continue; }
    try {
      globalThis.katex.render(node.dataset.tex, node, { displayMode: node.classList.contains("display"), throwOnError: false, trust: false, strict: "ignore" });
    } catch {
      node.textContent = node.dataset.tex;
    }
  }
  for (const code of root.querySelectorAll("pre > code[class*=language-]")) {
    const lang = /language-([\w+#.-]+)/.exec(code.className);
    if (lang) code.parentElement.dataset.lang = lang[1];
    code.classList.add("hljs");
  }
}
