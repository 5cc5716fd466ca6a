"""Your own text: uploads and pastes, their errors, disjoint parts, and nothing written to disk."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ghosted_core.data import assets, corpora
from ghosted_core.calibration.collect import CalibrationOptions
from ghosted_core.errors import GhostedError
from ghosted_core.model.loading import LoadOptions, load_model
from ghosted_core.run.options import RunOptions, parse_variants
from ghosted_core.run.pipeline import run
from ghosted_core.data.user_text import CALIBRATION_SHARE, MAX_BYTES, USER_CORPUS, canonical, from_bytes, from_file, \
    from_text, split_point

SENTENCE = "The river keeps its own counsel, and the town listens when the water rises. "


def long_text(paragraphs: int = 60) -> str:
    return "\n\n".join(f"{i}: " + SENTENCE * 6 for i in range(paragraphs))


@pytest.mark.parametrize("data_bytes, name, message", [
    (b"", "empty.txt", "is empty"),
    (b"  \n\n\t ", "blank.txt", "is empty"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4, "photo.txt", "not UTF-8 text"),
    ("café crème".encode("latin-1") * 50, "latin1.txt", "not UTF-8 text"),
    (b"x" * (MAX_BYTES + 1), "big.txt", "more than the 5 MB"),
    (b'{"text": "fine"}\n{"body": "no text here"}\n', "corpora.jsonl", 'line 2 of corpora.jsonl has no "text" field'),
    (b'{"text": "fine"}\nnot json\n', "corpora.jsonl", "line 2 of corpora.jsonl is not JSON"),
    (b'{"text": "  "}\n', "corpora.jsonl", 'no non-empty "text" field'),
    (b"some text", "notes.pdf", "upload a .txt file or a .jsonl file"),
])
def test_bad_uploads_get_a_clear_message(data_bytes, name, message):
    with pytest.raises(GhostedError, match=message):
        from_bytes(data_bytes, name)


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    with open(path, "wb") as fh:
        fh.truncate(MAX_BYTES + 10)  # sparse: 5 MB on paper, nothing to read
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("read a file over the limit"))
    with pytest.raises(GhostedError, match="5.0 MB, more than the 5 MB"):
        from_file(path)


def test_jsonl_records_become_documents_and_txt_stays_as_is(tmp_path):
    records = [{"text": f"record {i} " + SENTENCE, "id": i} for i in range(3)]
    jsonl = from_bytes("\n".join(json.dumps(r) for r in records).encode() + b"\n\n", "/some/where/corpora.jsonl")
    assert jsonl.documents == 3 and jsonl.source == "corpora.jsonl"  # the name, never the path
    assert jsonl.text == "\n\n".join(r["text"] for r in records)
    text = "\ufeffLine one\r\nLine two é\n"
    txt = from_bytes(text.encode("utf-8"), "notes.TXT")
    assert txt.text == text.removeprefix("\ufeff") and txt.documents == 1
    assert from_text("pasted words").source == "pasted text"
    with pytest.raises(GhostedError, match="empty"):
        from_text("   ")


def test_shared_text_splits_into_disjoint_parts_at_a_break():
    user = from_text(long_text())
    cal, ev = user.corpus("calibration", shared=True), user.corpus("evaluation", shared=True)
    assert cal.text + ev.text == user.text  # disjoint and complete
    assert cal.text.endswith("\n\n") and ev.text[0].isdigit()  # cut between paragraphs
    assert abs(len(cal.text) / len(user.text) - CALIBRATION_SHARE) < 0.02
    for part in (cal, ev):
        assert part.name == USER_CORPUS and part.label.startswith(USER_CORPUS) and not part.real
        assert not part.cacheable and "disjoint" in part.label
    whole = user.corpus("evaluation", shared=False)
    assert whole.text == user.text and "all of it" in whole.label
    assert split_point("a" * 100, 0.8) == 80  # no break anywhere: cut at the share itself


def test_canonical_names():
    assert {canonical(n) for n in ("yours", "your_text", "Your Text", "your-text")} == {USER_CORPUS}
    assert canonical("ptb") == "ptb"


def test_user_text_tokens_never_reach_the_disk_cache(smollm2_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTED_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path
    corpus = from_text(long_text()).corpus("calibration", shared=False)
    ids = corpora.tokenize_corpus(smollm2_tokenizer, corpus)
    assert ids.numel() > 1000
    assert not any(tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_too_short_text_says_how_many_tokens_it_has_and_needs(smollm2_tokenizer):
    corpus = from_text(SENTENCE * 3).corpus("calibration", shared=False)
    tokens = corpora.tokenize_corpus(smollm2_tokenizer, corpus).numel()
    with pytest.raises(GhostedError) as err:
        corpora.calibration_windows(smollm2_tokenizer, corpus, n=8, seqlen=64, seed=0, heldout=1)
    message = str(err.value)
    assert message.startswith(USER_CORPUS) and f"has {tokens:,} calibration tokens" in message
    assert f"need {9 * 64:,}" in message


@pytest.fixture(scope="module")
def loaded(tiny_model_folder):
    return load_model(str(tiny_model_folder), LoadOptions(device="cpu"))


def test_run_calibrates_and_evaluates_on_your_text(loaded, tiny_model_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("GHOSTED_CACHE", str(tmp_path / "cache"))
    user = from_text(long_text(120))
    options = RunOptions(model=str(tiny_model_folder), criterion="streamline", num_prune=2,
                         variants=parse_variants("none,ghost"), calibration=USER_CORPUS, user_text=user,
                         train_size=4, seqlen=32, eval_corpora=(USER_CORPUS,), eval_max_tokens=64, drift_windows=0,
                         quiet=True, calibrate=CalibrationOptions(quiet=True))
    result = run(options, loaded)
    report = result.to_json()
    assert report["calibration"]["label"].startswith(USER_CORPUS) and "first 80%" in report["calibration"]["label"]
    entry = report["corpora"][USER_CORPUS]
    assert entry["user"] is True and entry["real"] is False and "last 20%" in entry["label"]
    assert set(report["variants"]["ghost"]["ppl"]) == {USER_CORPUS}
    # the fit windows come from the calibration part only, the perplexity windows from the evaluation part
    cal_ids = corpora.tokenize_corpus(loaded.tokenizer, user.corpus("calibration", shared=True))
    ev_ids = corpora.tokenize_corpus(loaded.tokenizer, user.corpus("evaluation", shared=True))
    assert entry["tokens"] == 64 and ev_ids.numel() < cal_ids.numel()
    written = [f for f in (tmp_path / "cache").rglob("*") if f.is_file()] if (tmp_path / "cache").exists() else []
    assert written == []  # nothing of the run's text (or its tokens) outlives it on disk
    with pytest.raises(GhostedError, match="needs your text"):
        run(replace(options, user_text=None), loaded)


def test_unknown_corpus_mentions_your_text():
    from ghosted_core.run.options import validate

    with pytest.raises(GhostedError, match="your text"):
        validate(RunOptions(calibration="nowhere"))
