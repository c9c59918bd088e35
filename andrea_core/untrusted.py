"""Text that came from a run file (a `by`, a policy or arm name, a host, an error or problem line), made
safe on its way to a log line, a terminal or a markdown artifact. Anyone who can write into a run
directory chooses these strings; this is their one sanitizer.

`shown(text)`: one line of plain text of bounded length. Line breaks, escape codes and every other
control character, bidi overrides and invisible format characters are written as visible escapes
(`\\n`, `\\x1b`, `\\u202e`), so a forged string can neither start a line of its own (a fake progress
or error line that a log parser would believe), nor drive the terminal, nor reorder what is shown.
`markdown_code(text)`: the same as a code span whose fence no backtick inside can end.
`markdown_text(text)`: the same, then HTML and markdown syntax escaped and auto-links broken (bare URLs,
`www.` names, domain names and e-mail addresses, which GitHub-flavoured renderers such as the Prefect
UI's would otherwise turn into links): shown as text, never rendered.
"""

from __future__ import annotations

import re
import unicodedata

LIMIT = 1000  # characters of one shown string; more is cut, and the cut says how much

# Unicode categories never shown raw: controls (C0, DEL, C1: newlines, ESC), format characters (bidi
# overrides and isolates, zero-width characters), surrogates, unassigned code points, line and
# paragraph separators.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _visible(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown(text: object, limit: int = LIMIT) -> str:
    """`text` as one printable line of at most `limit` characters plus a note of what was cut: every
    character a terminal or log reader would act on, or that hides or reorders text, as a visible
    escape (`\\n`, `\\x1b`, `\\u202e`)."""
    text = str(text)
    out: list[str] = []
    size = 0
    for i, ch in enumerate(text[: limit + 1]):
        piece = _visible(ch) if unicodedata.category(ch) in _HIDDEN else ch
        if size + len(piece) > limit:
            return f"{''.join(out)}... ({len(text) - i} more characters)"
        out.append(piece)
        size += len(piece)
    return "".join(out)


# Markdown's inline syntax (links, images, emphasis, code, table cells, strikethrough); what matters only
# at the start of a line (lists, headings) cannot occur: these strings are always placed mid-line.
_MD_SPECIAL = re.compile(r"([\\`*_{}\[\]()#|~!])")
# What GFM renderers auto-link: a scheme's "://" or "mailto:", "www.", an e-mail's "@", and (renderers with
# fuzzy linking) a name with a dot before letters, "example.com". Their ":", "@" and "." are escaped
# (CommonMark: any ASCII punctuation may be), which splits the candidate so no renderer sees a link
# while the text shows unchanged.
_AUTOLINK = re.compile(r":|@|\.(?=[^\W\d_])")  # a dot before a letter (any script's: "evil.рф" too)


def markdown_text(text: object, limit: int = LIMIT) -> str:
    """An input-derived string as plain markdown text: HTML and markdown syntax shown, never interpreted
    (no link, auto-link, image, raw HTML, emphasis or table cell break); one line (`shown`)."""
    text = shown(text, limit).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = _MD_SPECIAL.sub(r"\\\1", text)
    return _AUTOLINK.sub(lambda m: "\\" + m.group(0), text)


def markdown_code(text: object, in_table: bool = False, limit: int = LIMIT) -> str:
    """An input-derived string as a markdown code span (`shown` first): verbatim, whatever backticks,
    brackets or HTML it holds (the fence is longer than any run of backticks inside, so none ends it).
    In a table cell "|" is escaped, which GitHub-flavoured markdown requires even inside code spans."""
    text = shown(text, limit)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text else ""
    if in_table:
        text = text.replace("|", "\\|")
    return f"{fence}{pad}{text}{pad}{fence}"
