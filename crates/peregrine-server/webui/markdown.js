// A small Markdown renderer for model answers: fenced and inline code, headings, lists, quotes,
// emphasis and http(s) links. Everything is HTML-escaped first, so a model cannot inject markup.
"use strict";

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// Inline spans of one escaped line: code first (its content is left alone), then links and emphasis.
function renderInline(escaped) {
  const codes = [];
  let text = escaped.replace(/`([^`]+)`/g, (_, code) => {
    codes.push(code);
    return `\u0000${codes.length - 1}\u0000`;
  });
  text = text
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/__([^_]+)__/g, "<strong>$1</strong>")
    .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
    .replace(/(^|\W)_([^_\s][^_]*)_(?=\W|$)/g, "$1<em>$2</em>");
  return text.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
}

// Blocks of text outside code fences.
function renderBlocks(text) {
  const out = [];
  let list = null; // "ul" or "ol" while inside a list
  let paragraph = [];
  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    paragraph = [];
  };
  const closeList = () => {
    if (list) out.push(`</${list}>`);
    list = null;
  };
  for (const raw of text.split("\n")) {
    const line = escapeHtml(raw);
    let m;
    if (!line.trim()) {
      flushParagraph();
      closeList();
    } else if ((m = line.match(/^(#{1,6})\s+(.*)$/))) {
      flushParagraph();
      closeList();
      out.push(`<h${m[1].length}>${renderInline(m[2])}</h${m[1].length}>`);
    } else if ((m = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/))) {
      flushParagraph();
      const kind = m[1] === undefined ? "ul" : "ol";
      if (list !== kind) {
        closeList();
        out.push(`<${kind}>`);
        list = kind;
      }
      out.push(`<li>${renderInline(m[2])}</li>`);
    } else if ((m = line.match(/^&gt;\s?(.*)$/))) {
      flushParagraph();
      closeList();
      out.push(`<blockquote>${renderInline(m[1])}</blockquote>`);
    } else {
      closeList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  closeList();
  return out.join("");
}

// The whole answer; an unclosed fence (an answer still streaming) runs to the end as code.
function renderMarkdown(text) {
  const parts = text.split(/^```[^\n]*$/m);
  return parts
    .map((part, i) => (i % 2 === 1 ? `<pre><code>${escapeHtml(part.replace(/^\n|\n$/g, ""))}</code></pre>` : renderBlocks(part)))
    .join("");
}
