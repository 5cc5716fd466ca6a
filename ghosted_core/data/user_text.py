"""Your own text as a corpus: pasted, or read from a .txt / .jsonl file, for calibration, evaluation or both.

A `UserText` lives in memory only, carried by `RunOptions.user_text` for one run and
addressed there by the corpus name `USER_CORPUS` ("your text"). Nothing is written to disk:
its tokens are never put in the tokenized-corpus cache of the built-in corpora (`data.corpora.Corpus`
with `cacheable=False`), and no registry or cache keeps it after the run.

When one run uses the text for both calibration and evaluation, the two never overlap: the
operators are fitted on the first `CALIBRATION_SHARE` of the characters and perplexity is
measured on the rest, cut at a document (or paragraph, or line) boundary near that point.
The labels say so. Used for one purpose only, the whole text serves it.
"""

from __future__ import annotations

import json
import re
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ghosted_core.data.corpora import Corpus
from ghosted_core.errors import GhostedError

log = logging.getLogger(__name__)

USER_CORPUS = "your text"  # the corpus name in options, tables, charts and results.json
ALIASES = ("your text", "your_text", "your-text", "yours")  # what the command line accepts for it
MAX_BYTES = 5 * 2**20  # 5 MB: the most text one upload may hold
CALIBRATION_SHARE = 0.8  # shared text: calibration reads the first 80% of characters, evaluation the rest
SUFFIXES = (".txt", ".jsonl")
DOCUMENT_JOINER = "\n\n"  # between .jsonl records, as the built-in corpora join documents
BINARY_CONTROL_SHARE = 0.01  # more control characters than this (tabs and newlines aside) is not text


def canonical(name: str) -> str:
    """The corpus name for any accepted spelling of "your text"; other names unchanged."""
    return USER_CORPUS if name.strip().lower() in ALIASES else name


@dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity, never by its megabytes of text
class UserText:
    """Text a user brought for one run, with where it came from (for labels)."""

    text: str = field(repr=False)  # never in a repr, a log line or an error message
    source: str  # "pasted text" or the file's name (never its path), in safe characters only
    documents: int  # .jsonl records, or 1

    @property
    def characters(self) -> int:
        return len(self.text)

    def describe(self) -> str:
        """'notes.txt, 12,345 characters' or 'data.jsonl, 40 documents, 1,234,567 characters'."""
        docs = f"{self.documents:,} documents, " if self.documents > 1 else ""
        return f"{self.source}, {docs}{self.characters:,} characters"

    def corpus(self, split: str, shared: bool) -> Corpus:
        """The calibration or evaluation part as a `Corpus` (kept out of the on-disk token cache).

        `shared`: the same run also uses the text for the other split, so the parts are disjoint.
        """
        if split not in ("calibration", "evaluation"):
            raise GhostedError(f"unknown split {split!r}; use calibration or evaluation")
        if not shared:
            return Corpus(USER_CORPUS, f"{USER_CORPUS} ({self.describe()}; all of it for {split})", False, split,
                          self.text, cacheable=False)
        cut = split_point(self.text, CALIBRATION_SHARE)
        part = self.text[:cut] if split == "calibration" else self.text[cut:]
        where = (f"first {CALIBRATION_SHARE:.0%}" if split == "calibration" else f"last {1 - CALIBRATION_SHARE:.0%}")
        label = (f"{USER_CORPUS} ({self.describe()}; {split}: the {where} of the characters, "
                 f"disjoint from the {'evaluation' if split == 'calibration' else 'calibration'} part)")
        return Corpus(USER_CORPUS, label, False, split, part, cacheable=False)


def split_point(text: str, share: float) -> int:
    """A character index near `share` of the text, moved back to the closest document, line or word break."""
    target = int(len(text) * share)
    for sep in (DOCUMENT_JOINER, "\n", " "):
        found = text.rfind(sep, 0, target)
        if found > 0.5 * target:  # a break not too far back: keep the parts near the asked proportion
            return found + len(sep)
    return target


def from_text(text: str, source: str = "pasted text") -> UserText:
    """Pasted text; GhostedError when it is empty or too large."""
    if len(text.encode("utf-8", errors="surrogatepass")) > MAX_BYTES:
        raise GhostedError(f"{source} is larger than {MAX_BYTES // 2**20} MB; use a shorter text")
    _check_text(text, source)
    return UserText(text, source, 1)


def from_bytes(data: bytes, filename: str) -> UserText:
    """An uploaded .txt or .jsonl file's bytes (a "text" field per .jsonl line); clear errors for bad files."""
    name = safe_name(filename)
    suffix = Path(name).suffix.lower()
    if suffix not in SUFFIXES:
        raise GhostedError(f"{name}: upload a .txt file or a .jsonl file with a \"text\" field per line")
    if len(data) > MAX_BYTES:
        raise GhostedError(f"{name} is {len(data) / 2**20:.1f} MB, more than the {MAX_BYTES // 2**20} MB an upload "
                           "may hold; upload a shorter part of it")
    if not data.strip():
        raise GhostedError(f"{name} is empty; upload a file with some text in it")
    text = _decode(data, name)
    if suffix == ".jsonl":
        docs = _jsonl_documents(text, name)
        return UserText(DOCUMENT_JOINER.join(docs), name, len(docs))
    _check_text(text, name)
    return UserText(text, name, 1)


def safe_name(filename: str) -> str:
    """A file's name (never its folders) in letters, digits and ` ._-` only: it is shown in labels and pages."""
    name = re.sub(r"[^\w .-]", "_", Path(str(filename)).name, flags=re.ASCII).strip()[-100:]
    return name or "upload"


def from_file(path: str | Path) -> UserText:
    """A .txt or .jsonl file on disk, its size checked before it is read."""
    path = Path(path)
    if not path.is_file():
        raise GhostedError(f"no such file: {path}")
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise GhostedError(f"{path.name} is {size / 2**20:.1f} MB, more than the {MAX_BYTES // 2**20} MB an upload "
                           "may hold; upload a shorter part of it")
    return from_bytes(path.read_bytes(), path.name)


def _decode(data: bytes, name: str) -> str:
    """UTF-8 text (a byte-order mark allowed); binary data or another encoding is refused."""
    wrong = (f"{name} is not UTF-8 text (a binary file, or text in another encoding); "
             "save it as UTF-8 .txt or .jsonl and upload it again")
    if b"\x00" in data:
        raise GhostedError(wrong)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise GhostedError(wrong) from None
    controls = sum(1 for ch in text if ord(ch) < 32 and ch not in "\n\r\t\f")
    if controls > BINARY_CONTROL_SHARE * len(text):
        raise GhostedError(wrong)
    return text


def _jsonl_documents(text: str, name: str) -> list[str]:
    """The "text" field of every non-blank line."""
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise GhostedError(f"line {number} of {name} is not JSON ({err.msg}); "
                               "write one JSON object with a \"text\" field per line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise GhostedError(f"line {number} of {name} has no \"text\" field holding a string; "
                               "write one JSON object with a \"text\" field per line")
        if record["text"].strip():
            docs.append(record["text"])
    if not docs:
        raise GhostedError(f"{name} has no non-empty \"text\" field; upload a file with some text in it")
    return docs


def _check_text(text: str, source: str) -> None:
    if not text.strip():
        raise GhostedError(f"{source} is empty; paste or upload some text")
