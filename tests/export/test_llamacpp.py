"""llama.cpp's own tools on a tiny random Llama converted by its own converter: llama-bench, llama-quantize,
llama-imatrix, and the failures each gives as one line.

Skipped without `make llamacpp`, except in CI (CI=true), where a missing build fails (see test_gguf.py).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from conftest import make_tiny_model
from ghosted_core.errors import GhostedError
from ghosted_core.export.gguf import convert_to_gguf
from ghosted_core.export.llamacpp import (QUANT_TYPES, compute_imatrix, llamacpp_bench, llamacpp_generate,
                                          quantize_gguf)
from test_gguf import PROMPT, export_pruned, llamacpp  # noqa: F401 (llamacpp: a fixture)


@pytest.fixture(scope="module")
def tiny_gguf(llamacpp, smollm2_tokenizer, tmp_path_factory):
    """A tiny random Llama (6 blocks of width 64; llama.cpp's k-quants need rows of 256) without block 2, as a
    stock folder and its f16 GGUF."""
    model = make_tiny_model("llama", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                            tie_word_embeddings=True, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2)
    work = tmp_path_factory.mktemp("llamacpp")
    fit_ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    folder = export_pruned(model, smollm2_tokenizer, (2,), "none", work / "tiny", fit_ids)
    return convert_to_gguf(folder, work / "tiny-f16.gguf", "f16")


def test_bench_reports_prefill_and_decode_speeds(tiny_gguf):
    result = llamacpp_bench(tiny_gguf.path, threads=1, n_prompt=16, n_gen=4, repetitions=3)
    assert result.threads == 1 and result.repetitions == 3
    for speed, tokens in ((result.prefill, 16), (result.decode, 4)):
        assert speed.tokens == tokens and len(speed.samples) == 3
        assert speed.mean == pytest.approx(statistics.mean(speed.samples), rel=1e-3) and speed.mean > 0
        assert speed.stddev == pytest.approx(statistics.stdev(speed.samples), rel=1e-2, abs=1e-6)
        assert min(speed.samples) <= speed.median <= max(speed.samples)
    only_decode = llamacpp_bench(tiny_gguf.path, n_prompt=0, n_gen=2, repetitions=1)
    assert only_decode.prefill is None and only_decode.decode.tokens == 2 and only_decode.decode.stddev == 0
    assert set(result.to_json()) == {"prefill", "decode", "threads", "repetitions", "seconds"}


def test_bench_failures_are_one_line(tiny_gguf, tmp_path):
    with pytest.raises(GhostedError, match="some tokens to time"):
        llamacpp_bench(tiny_gguf.path, n_prompt=0, n_gen=0)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(GhostedError, match=r"llama-bench on bad.gguf failed \(exit \d+\): .*") as err:
        llamacpp_bench(bad, n_prompt=4, n_gen=1, repetitions=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_quantize_writes_a_smaller_gguf_that_llamacpp_runs(tiny_gguf, qtype, tmp_path):
    out = tmp_path / f"tiny-{qtype}.gguf"
    result = quantize_gguf(tiny_gguf.path, out, qtype, threads=1)
    assert result.path == out and result.outtype == qtype and result.bytes == out.stat().st_size
    assert result.bytes < 0.75 * tiny_gguf.bytes
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the temporary was renamed, nothing left over
    assert len(llamacpp_generate(out, PROMPT, max_new_tokens=4).tokens) == 4


def test_quantize_refusals_and_failures(tiny_gguf, tmp_path):
    with pytest.raises(GhostedError, match="unknown quantized GGUF type 'q3_k_s'; use one of q4_k_m"):
        quantize_gguf(tiny_gguf.path, tmp_path / "x.gguf", "q3_k_s")
    with pytest.raises(GhostedError, match="importance matrix .* not found"):
        quantize_gguf(tiny_gguf.path, tmp_path / "x.gguf", "q4_k_m", imatrix=tmp_path / "none.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF garbage")
    with pytest.raises(GhostedError, match=r"llama-quantize \(bad.gguf to Q4_K_M\) failed \(exit \d+\): ") as err:
        quantize_gguf(bad, tmp_path / "out" / "x.gguf", "q4_k_m", threads=1)
    assert "\n" not in str(err.value) and list((tmp_path / "out").iterdir()) == []


def test_imatrix_changes_the_k_quant_and_names_no_path(tiny_gguf, tmp_path):
    """An importance matrix from calibration text changes Q4_K_M's weights (not its size), and the GGUF records
    only the text's file name, never a path of this machine."""
    from ghosted_core.data.corpora import load_corpus

    text = tmp_path / "texts" / "calibration.txt"
    text.parent.mkdir()
    text.write_text(load_corpus("ptb", "calibration").text[:12_000])
    imatrix = compute_imatrix(tiny_gguf.path, text, tmp_path / "tiny.imatrix.gguf", context=128, chunks=4)
    assert imatrix.stat().st_size > 0
    plain = quantize_gguf(tiny_gguf.path, tmp_path / "plain.gguf", "q4_k_m", threads=1)
    weighted = quantize_gguf(tiny_gguf.path, tmp_path / "weighted.gguf", "q4_k_m", imatrix=imatrix, threads=1)
    assert abs(weighted.bytes - plain.bytes) < 0.02 * plain.bytes
    assert weighted.path.read_bytes() != plain.path.read_bytes()
    data = weighted.path.read_bytes()
    assert b"calibration.txt" in data and b"tiny.imatrix.gguf" in data and str(tmp_path).encode() not in data
    with pytest.raises(GhostedError, match=r"llama-imatrix on tiny-f16.gguf failed .*at least 256 tokens"):
        short = tmp_path / "short.txt"
        short.write_text("Too short.")
        compute_imatrix(tiny_gguf.path, short, tmp_path / "short.imatrix.gguf", context=128)
    assert not (tmp_path / "short.imatrix.gguf").exists()


def test_missing_tool_is_a_stale_build(tmp_path, monkeypatch):
    """A build made before llama-bench was added (BUILD_INFO and the old tools only) asks for `make llamacpp`."""
    from ghosted_core.export.llamacpp import LLAMACPP_ENV, find_llamacpp

    stale = tmp_path / "stale"
    (stale / "bin").mkdir(parents=True)
    (stale / "convert" / "gguf-py" / "gguf").mkdir(parents=True)
    (stale / "convert" / "convert_hf_to_gguf.py").write_text("")
    (stale / "BUILD_INFO").write_text("targets llama-completion llama-perplexity\n")
    for tool in ("llama-completion", "llama-perplexity"):
        (stale / "bin" / tool).write_text("")
    monkeypatch.setenv(LLAMACPP_ENV, str(stale))
    with pytest.raises(GhostedError, match=r"llama-quantize is missing\): run `make llamacpp`"):
        find_llamacpp()


def test_the_build_script_builds_every_tool_and_knows_an_up_to_date_cache(tmp_path):
    """scripts/build_llamacpp.sh's targets are TOOLS; a cache whose BUILD_INFO lists them is left alone (a stale
    one is rebuilt: not run here, it downloads and compiles), and `make llamacpp` always asks the script."""
    import re
    import subprocess
    from pathlib import Path

    from ghosted_core.export.llamacpp import TOOLS

    root = Path(__file__).parents[2]
    script = (root / "scripts" / "build_llamacpp.sh").read_text()
    assert tuple(re.search(r"^targets=\(([^)]*)\)", script, re.MULTILINE).group(1).split()) == TOOLS
    makefile = (root / "Makefile").read_text()
    assert re.search(r"^llamacpp: \| \$\(STAMP\)\n\tscripts/build_llamacpp.sh", makefile, re.MULTILINE)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "BUILD_INFO").write_text(f"llama.cpp x\ntargets {' '.join(TOOLS)}\nseconds 1\n")
    done = subprocess.run(["bash", str(root / "scripts" / "build_llamacpp.sh"), str(cache), "0.3.36", "python3"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "already built" in done.stdout


def test_perplexity_survives_the_logger_losing_its_last_lines(tiny_gguf, tmp_path, monkeypatch):
    """llama.cpp's logger thread is never flushed at exit, so the last lines (the last window's running estimate
    and the final one) can be lost on a loaded machine. Every try that loses them is repeated; the last try asks
    for one window more, whose computation lets the estimate over the windows asked for be printed first."""
    import ghosted_core.export.llamacpp as llamacpp_module
    from ghosted_core.data.corpora import load_corpus

    text = tmp_path / "ptb.txt"
    text.write_text(load_corpus("ptb").text[:4_000])  # ~1,000 tokens: 7 or so windows of 128
    whole = llamacpp_module.llamacpp_perplexity(tiny_gguf.path, text, 128, 4)
    real_run, asked = llamacpp_module._run, []

    def losing_the_tail(cmd, what):
        asked.append(int(cmd[cmd.index("--chunks") + 1]))
        output = real_run(cmd, what)
        last = list(llamacpp_module._RUNNING.finditer(output))[-1]
        return output[: last.start()]  # the last window's running value onwards never printed

    monkeypatch.setattr(llamacpp_module, "_run", losing_the_tail)
    recovered = llamacpp_module.llamacpp_perplexity(tiny_gguf.path, text, 128, 4)
    assert asked == [4] * (llamacpp_module.PERPLEXITY_ATTEMPTS - 1) + [5]
    assert recovered.value == pytest.approx(whole.value, abs=1e-4) and recovered.chunks == whole.chunks == 4
    assert math.isnan(recovered.error) and whole.error > 0
    asked.clear()
    with pytest.raises(GhostedError, match="printed no estimate"):  # every window the text has: none more to compute
        llamacpp_module.llamacpp_perplexity(tiny_gguf.path, text, 128, 100)
    assert len(asked) == llamacpp_module.PERPLEXITY_ATTEMPTS
