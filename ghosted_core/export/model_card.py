"""The model card (README.md) of an export, and the run facts a variant's record carries for it.

`run_record` collects what a card states from a finished run: the base model (a Hub id
where one is known, never a local path), the calibration corpus with its stand-in label and
size, the boundary errors and the perplexities with their corpus labels. The pipeline adds
it to each variant's `config.ghosted` record, so any saved variant can describe itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ghosted_core.model.embedded import EMBEDDED
from ghosted_core.recovery.operators import OPERATORS

def base_model_facts(name: str) -> dict[str, Any]:
    """Where the dense model came from, without naming a path of this machine."""
    if name in EMBEDDED:
        return {"source": "embedded", "name": name, "hub_id": EMBEDDED[name].hub_id,
                "description": EMBEDDED[name].description}
    if Path(name).expanduser().is_dir():
        return {"source": "local", "name": Path(name).name, "hub_id": None, "description": "a local model folder"}
    return {"source": "hub", "name": name, "hub_id": name, "description": f"Hugging Face Hub model {name}"}


def run_record(report: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """Facts of a run (`RunResult.to_json()`) about one variant, for its `ghosted` record and card."""
    entry = report["variants"].get(variant, {})
    dense, none = report["variants"].get("dense", {}), report["variants"].get("none", {})
    perplexity = {}
    for corpus, info in report.get("corpora", {}).items():
        if corpus in entry.get("ppl", {}):
            perplexity[corpus] = {"label": info["label"], "real": info["real"], "tokens": info.get("tokens"),
                                  "dense": dense.get("ppl", {}).get(corpus), "none": none.get("ppl", {}).get(corpus),
                                  "variant": entry["ppl"][corpus]}
    calibration = {key: report["calibration"][key] for key in ("corpus", "label", "sequences", "seqlen", "tokens", "seed")}
    return {
        "variant": variant,
        "base_model": base_model_facts(report["model"]),
        "dense_layers": report["num_layers"],
        "criterion": report["criterion"],
        "calibration": calibration,
        "boundary_error": entry.get("boundary_error", []),
        "fit_notes": list(dict.fromkeys(n for fit in entry.get("fits", []) for n in fit.get("notes", []))),
        "perplexity": perplexity,
    }


def fmt_ppl(value: float | None) -> str:
    """A perplexity as the card shows it."""
    return "-" if value is None else f"{value:.2f}" if value < 1e5 else f"{value:.3g}"


def _yaml_list(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _changes(record: Mapping[str, Any]) -> list[str]:
    operator = record.get("operator", "none")
    spec = OPERATORS.get(operator)
    removed = record.get("removed_layers", [])
    dense_layers = record.get("dense_layers")
    kept = f" ({dense_layers} → {dense_layers - len(removed)} blocks)" if dense_layers else ""
    runs = ", ".join(f"{start}–{end - 1}" for start, end in record.get("boundaries", []))
    lines = [f"- **Removed blocks**: {removed}{kept}; contiguous runs: {runs or '-'}"
             + (f", chosen by `{record['criterion']}`" if record.get("criterion") else "")]
    if spec is not None:
        fit = "sequential (each boundary fitted on the already recovered model upstream)" if record.get("sequential") \
            else "independent (every boundary fitted on the dense model)"
        lines.append(f"- **Recovery operator**: `{operator}` ({spec.paper}): {spec.description}; fit: {fit}")
    cal = record.get("calibration")
    if cal:
        lines.append(f"- **Calibration**: {cal['label']} (`{cal['corpus']}`), {cal['sequences']} sequences × "
                     f"{cal['seqlen']} tokens = {cal['tokens']} tokens, seed {cal['seed']}")
    for err in record.get("boundary_error", []):
        if err.get("heldout") is not None:
            lines.append(f"- **Boundary {err['boundary']} error** (held-out calibration text, 1 = plain pruning): "
                         f"{err['heldout']:.3f} all tokens" + ("" if err.get("heldout_ordinary") is None
                                                                  else f", {err['heldout_ordinary']:.3f} ordinary tokens"))
    lines += [f"- Note from the fit: {note}" for note in record.get("fit_notes", [])]
    lines += _distilled(record.get("distill"))
    return lines


def _distilled(distill: Mapping[str, Any] | None) -> list[str]:
    """The card's line on a distillation after the fit: what trained, on what, how far, and whether it stays stock."""
    if not distill:
        return []
    loss = f"the dense model's top-{distill['top_k']}" if distill["top_k"] < distill["vocabulary"] else \
        "the dense model's full"
    start, best = distill.get("start_val"), distill.get("best_val")
    moved = "" if start is None or best is None else f"; validation KL {start:.4f} → {best:.4f}"
    stock = "only weights a stock checkpoint has, so the model stays stock" if distill.get("stock") else \
        "the recovery operator's own weights, so the model needs the remote code below"
    return [f"- **Distilled after the fit**: trained `{distill['target']}` ({distill['description']}; "
            f"{distill['parameters']:,} parameters), the KL to {loss} next-token distribution on "
            f"{distill['tokens']:,} tokens of {distill['corpus']} ({distill['steps']} AdamW steps, lr "
            f"{distill['schedule']['lr']:g} on a cosine schedule, the best of the validations on held-out calibration "
            f"windows kept{moved}): {stock}"]


def _perplexity_table(record: Mapping[str, Any]) -> list[str]:
    table = record.get("perplexity") or {}
    if not table:
        return ["No perplexity was measured in the run that made this model."]
    lines = ["Measured by the run that made this model (exp of the mean token NLL; lower is better):", "",
             "| corpus | tokens | dense model | plain pruning | this model |", "|---|---|---|---|---|"]
    for corpus, row in table.items():
        label = row["label"] if row.get("real") or "stand-in" in row["label"] else f"{row['label']} (stand-in)"
        lines.append(f"| {corpus}: {label} | {row.get('tokens') or '-'} | {fmt_ppl(row.get('dense'))} | "
                     f"{fmt_ppl(row.get('none'))} | {fmt_ppl(row.get('variant'))} |")
    lines += ["", "Stand-in corpora are offline substitutes (e.g. Wikipedia paragraphs for WikiText-2); their "
              "numbers are not comparable with published WikiText-2 or C4 figures."]
    return lines


def _loading(mode: str, reason: str, architecture: str) -> list[str]:
    remote = mode == "remote_code"
    flag = ", trust_remote_code=True" if remote else ""
    lines = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             'path = "path/to/this/folder"  # or the Hub repo id it was uploaded to',
             f"model = AutoModelForCausalLM.from_pretrained(path{flag})",
             "tokenizer = AutoTokenizer.from_pretrained(path)",
             'ids = tokenizer("The capital of France is", return_tensors="pt").input_ids',
             "print(tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0]))", "```", ""]
    if remote:
        lines += [f"**This model needs remote code** (`trust_remote_code=True`): {reason}. "
                  "`modeling_ghosted.py` in this folder (it imports only torch and transformers) builds the stock "
                  f"`{architecture}` with fewer blocks and inserts the recovery operators as modules; `config.json` "
                  "points at it through `auto_map`. Without `trust_remote_code=True`, transformers refuses the folder "
                  "(its model type is not a stock one) instead of loading it wrongly. Serving engines that load only "
                  "stock architectures (vLLM, TGI, llama.cpp) cannot serve it; a stock-foldable operator ("
                  + ", ".join(f"`{name}`" for name, spec in OPERATORS.items() if spec.stock)
                  + ") gives a stock checkpoint instead."]
    else:
        lines += [f"A stock `{architecture}` checkpoint: fewer `num_hidden_layers`, per-layer config lists sliced, "
                  f"{reason}. It loads in plain transformers and in engines that serve this architecture "
                  "(vLLM, TGI; llama.cpp after its `convert_hf_to_gguf.py`)."]
    return lines


def model_card(record: Mapping[str, Any], mode: str, reason: str, architecture: str) -> str:
    """README.md for an export: YAML metadata, what was removed and fitted, the run's numbers, how to load."""
    base = record.get("base_model") or {}
    operator = record.get("operator", "none")
    tags = ["ghosted-layers", "layer-pruning", "depth-pruning", operator.replace("_", "-")]
    tags += ["custom_code"] if mode == "remote_code" else []
    tags += ["knowledge-distillation"] if record.get("distill") else []
    meta = ["---", f"base_model: {base['hub_id']}" if base.get("hub_id") else None, "library_name: transformers",
            "pipeline_tag: text-generation", "tags:", _yaml_list(tags), "---"]
    removed = record.get("removed_layers", [])
    title = base.get("hub_id") or base.get("name") or "a causal LM"
    lines = [line for line in meta if line is not None]
    distilled = ", then distilled" if record.get("distill") else ""
    lines += ["", f"# {title}, {len(removed)} blocks removed, recovered with `{operator}`{distilled}", "",
              f"Made with Ghosted Layers Studio from {base.get('description', 'a causal LM')}: decoder blocks removed "
              "and a training-free recovery operator fitted at each cut. Export format: "
              f"**{'remote code' if mode == 'remote_code' else 'stock checkpoint'}**.", "",
              "## What was changed", "", *_changes(record), "", "## Perplexity", "", *_perplexity_table(record), "",
              "## How to load", "", *_loading(mode, reason, architecture), ""]
    return "\n".join(lines)


GGUF_TYPE_NOTES = {"f16": "16-bit floats, the converter's own output", "q8_0": "8-bit, near lossless",
                   "q6_k": "6-bit k-quant", "q5_k_m": "5-bit k-quant mix", "q4_k_m": "4-bit k-quant mix, the usual download"}


def gguf_section(files: Sequence[Mapping[str, Any]], commit: str, version: str, imatrix: str | None = None,
                 eval_label: str = "", reference_ppl: float | None = None) -> str:
    """The card's section for the GGUF files beside the checkpoint: each file with its type, size and
    llama-perplexity (`GGUFResult.to_json` entries), what wrote them and how llama.cpp runs them."""
    scored = any("ppl" in f for f in files)
    header = "| file | type | size |" + (" perplexity (llama.cpp) |" if scored else "")
    rows = [header, "|---|---|---|" + ("---|" if scored else "")]
    for f in files:
        note = GGUF_TYPE_NOTES.get(f["type"], "")
        ppl = f" {f['ppl']:.3f} ± {f['ppl_error']:.3f} |" if "ppl" in f else (" - |" if scored else "")
        rows.append(f"| `{f['file']}` | {f['type']}{f' ({note})' if note else ''} | {f['bytes'] / 1e6:.1f} MB |{ppl}")
    made = (f"written from this folder by llama.cpp's own `convert_hf_to_gguf.py` (f16) and `llama-quantize` (the "
            f"others, from that f16) of llama.cpp {commit}, from llama-cpp-python {version}'s source")
    lines = ["", "## GGUF (llama.cpp)", "", f"These files were {made}.", ""]
    if imatrix:
        lines += [f"The k-quants used an importance matrix (`llama-imatrix`) computed on {imatrix}.", ""]
    lines += rows + [""]
    if scored:
        first = next(f for f in files if "ppl" in f)
        reference = "" if reference_ppl is None else (f" The same variant in transformers (fp32) on the same windows: "
                                                      f"{reference_ppl:.3f}.")
        lines += [f"Perplexity: `llama-perplexity` on {eval_label or 'a held-out text'}, {first['chunks']} windows of "
                  f"{first['context']} tokens, the second half of each scored.{reference}", ""]
    name = files[0]["file"] if files else "MODEL.gguf"
    lines += ["Run one with llama.cpp:", "", "```bash", f'llama-cli -m {name} -p "The capital of France is" -n 32',
              f"llama-server -m {name} --port 8080   # an OpenAI-compatible server", "```", ""]
    return "\n".join(lines)
