"""Which model types the studio cuts: every decoder-only type in transformers' causal-LM mapping, tried on a tiny
random model built from its config's defaults, through the command line.

    .venv/bin/python bench/families.py              # every type; resumes where it stopped (results file)
    .venv/bin/python bench/families.py --types llama,phi3 --out /tmp/f.json
    .venv/bin/python bench/families.py --page       # docs/families.md from the results file, runs nothing

Per type, in a child process forked from one that imported everything once (a hang or a crash costs that type
only, after --timeout seconds): the config
class's defaults at a tiny size (4 blocks, width 64, 4 experts where it has experts, SmolLM2's tokenizer), saved
as a local folder; then the CLI: streamline removes 1 block, none + ghost_capped (+ magcomp and replaceme where
the architecture table names the writers), 4 × 32 calibration tokens of PTB, perplexity on 64, greedy text, and
`--save_model --export auto` (stock where the variant folds, remote code for ghost_capped). Each folder is reloaded
with transformers and must give the CLI's greedy text. Written per type: runs (and the variants), reloads, or the first line of the reason it stopped.

This is coverage, not quality: random weights say nothing about recovery (the tests' trained tiny models do).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_paths import result_path  # noqa: E402  (bench/ is the script's folder)

PAGE = ROOT / "docs" / "families.md"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            n_inner=128, ffn_dim=128, d_ff=128, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, rotary_dim=8, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
MAX_PARAMETERS = 20_000_000  # a type whose defaults stay big at these sizes (fields under other names) is skipped
# what a tiny size breaks in a few types' defaults (their defaults assume a real width)
EXTRA = {
    "gemma3": dict(mm_tokens_per_image=4),
    "qwen3_5_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 1, 1]}),
    "qwen3_5_moe_text": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                              "mrope_section": [2, 1, 1]}),
}


def tiny_config(model_type: str, vocab_size: int):
    """The type's config class with its defaults, at the tiny sizes it has fields for."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = cls()
    if getattr(defaults, "text_config", None) is not None:  # a multimodal wrapper: its decoder and tower, tiny
        text = {k: v for k, v in tiny_config(defaults.text_config.model_type, vocab_size).to_dict().items()
                if k != "layer_types"}
        parts = {"text_config": text}
        if getattr(defaults, "vision_config", None) is not None:
            vision = defaults.vision_config.to_dict()
            parts["vision_config"] = vision | {k: v for k, v in VISION.items() if k in vision}
        return cls(**parts, **EXTRA.get(model_type, {}))
    known = set(defaults.to_dict()) | set(getattr(cls, "attribute_map", {}))  # n_embd answers to hidden_size
    values = {k: v for k, v in TINY.items() if k in known} | {"vocab_size": vocab_size} | EXTRA.get(model_type, {})
    return cls(**values)


def one(model_type: str) -> dict:
    """The CLI on a tiny model of `model_type` (run in its own process)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ghosted_core import cli
    from ghosted_core.architectures import ARCHITECTURES, architecture_of
    from ghosted_core.model.embedded import EMBEDDED
    from ghosted_core.model.wrapper import is_wrapper_config

    torch.set_num_threads(1)
    spec = EMBEDDED["smollm2-135m"]
    tokenizer = AutoTokenizer.from_pretrained(importlib.util.find_spec(spec.package).submodule_search_locations[0],
                                              gguf_file=spec.gguf_file)
    record: dict = {"type": model_type, "in_table": model_type in ARCHITECTURES}
    try:
        config = tiny_config(model_type, len(tokenizer))
        with torch.device("meta"):
            count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if count > MAX_PARAMETERS:
            return record | {"stage": "build", "reason": f"the config's defaults stay at {count / 1e6:.0f}M parameters "
                                                         "with the tiny sizes (its size fields have other names)"}
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            model(torch.arange(3, 19)[None])  # transformers itself runs it: what fails later is ours
    except Exception as err:  # noqa: BLE001  a default that does not build or run at a tiny size is a reason too
        return record | {"stage": "build", "reason": f"the tiny config from defaults does not run in transformers: "
                                                     f"{type(err).__name__}: {err}"[:300]}
    multimodal = is_wrapper_config(config)  # its text decoder is cut; its exports are stock only
    arch = architecture_of(config.get_text_config())
    record["kind"] = ("multimodal " if multimodal else "") + (arch.kind if not arch.generic else "generic")
    folds = [v for v, r in (("magcomp", "scale"), ("replaceme", "branch")) if arch.refusal(r, v, config.get_text_config()) is None
             and (not multimodal or v != "replaceme" or arch.branch_folds)]
    variants = ["none"] + ([] if multimodal else ["ghost_capped"]) + folds
    with tempfile.TemporaryDirectory() as tmp:
        folder, out = Path(tmp) / "model", Path(tmp) / "out"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        args = ["--model", str(folder), "--pruning_method", "streamline", "--total_num_prune", "1",
                "--insert_type", ",".join(variants), "--calibration_data", "ptb", "--train_size", "4", "--seqlen", "32",
                "--eval_ppl", "ptb", "--eval_max_tokens", "64", "--prompt", "The market", "--max_new_tokens", "4",
                "--save_model", str(out / "models"), "--export", "auto", "--outdir", str(out), "--no_speed",
                "--device", "cpu", "--quiet"]
        started = time.perf_counter()
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(args)
        except Exception as err:  # noqa: BLE001  a bug shows as its exception's first line
            return record | {"stage": "cli", "reason": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"}
        record["seconds"] = round(time.perf_counter() - started, 1)
        if code not in (0, None):
            last = (errors.getvalue().strip().splitlines() or ["no message"])[-1]
            return record | {"stage": "refused", "reason": last[:300]}
        result = json.loads((out / "results.json").read_text())
        record["variants"] = variants
        record["perplexity"] = {k: v.get("ppl") for k, v in result["variants"].items()}
        reloaded = {}
        for name in variants:  # stock folders in plain transformers; ghost_capped's with its modeling file
            saved = reload(out / "models" / name)
            saved.eval()
            ids = tokenizer("The market", return_tensors="pt").input_ids
            with torch.no_grad():
                text = tokenizer.decode(saved.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:])
            reloaded[name] = text == result["variants"][name]["generation"]
        record["reloads"] = reloaded
        return record | {"stage": "done"}


def reload(folder: Path):
    """A saved folder in transformers: its stock class, or the class its config's auto_map names in the folder's
    own modeling file (imported from that file here, as transformers' remote code would import it)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    if "auto_map" not in json.loads((folder / "config.json").read_text()):
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    file_name, class_name = auto_map.split(".")
    spec = importlib.util.spec_from_file_location(f"saved_{file_name}", folder / f"{file_name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name).from_pretrained(folder)


def causal_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_all(types: list[str], path: Path, timeout: int) -> None:
    """Each type not in the results file yet, in a child forked from this process (torch, transformers and the CLI
    imported once): a crash or a hang costs that type only. Each result is written as it comes."""
    import signal

    from ghosted_core import cli  # noqa: F401  imported before the forks
    import torch  # noqa: F401

    results = json.loads(path.read_text()) if path.exists() else {}
    for model_type in types:
        if model_type in results:
            continue
        started = time.perf_counter()
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: one type, its record on the pipe
            os.close(reader)
            try:
                record = one(model_type)
            except BaseException as err:  # noqa: BLE001  what a type breaks is its result
                record = {"type": model_type, "stage": "crash", "reason": f"{type(err).__name__}: {err}"[:300]}
            os.write(writer, json.dumps(record).encode())
            os._exit(0)
        os.close(writer)
        signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
        signal.alarm(timeout)
        with os.fdopen(reader) as pipe:
            text = pipe.read()
        _, status = os.waitpid(pid, 0)
        signal.alarm(0)
        if text:
            record = json.loads(text)
        elif os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            record = {"type": model_type, "stage": "timeout", "reason": f"no answer in {timeout} s"}
        else:
            record = {"type": model_type, "stage": "crash", "reason": f"the process ended with status {status}"}
        record["wall_seconds"] = round(time.perf_counter() - started, 1)
        results[model_type] = record
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        print(f"{model_type}: {record['stage']} {record.get('reason', '')[:120]}", flush=True)


# What each family's stock export needs in the runtimes people serve with (tests/export/test_gguf_families.py
# holds the llama.cpp column; the vLLM column is what its loaders read, held by tests/export/test_vllm_gpu.py on a GPU)
SERVING = {
    "llama": ("runs", ""), "mistral": ("runs (no sliding window in llama.cpp: the export warns)", ""),
    "qwen2": ("runs (with Qwen's vocabulary; no sliding window in llama.cpp: the export warns)", "`max_window_layers` recounted"),
    "qwen3": ("runs", ""),
    "gemma3_text": ("runs: kept layers' window pattern written, attention scale folded into q_norm (27B cut)",
                    "`layer_types` sliced"),
    "phi3": ("runs (Phi-4-mini's BPE vocabulary: the export keeps its GPT2Tokenizer class; no sliding window in "
             "llama.cpp: the export warns)", ""),
    "olmo2": ("runs (untied, as its checkpoints)", ""), "olmo3": ("runs", "`layer_types` sliced"),
    "smollm3": ("runs where the cut keeps every 4th block RoPE-less; refused otherwise (llama.cpp reads no list)",
                "`no_rope_layers` sliced"),
    "granite": ("runs", "multipliers kept in the config"),
    "gemma2": ("runs (its sentencepiece model kept): window pattern written, scale folded into q_proj (27B cut)",
               "`layer_types` sliced"),
    "gemma4_text": ("runs: read from the file (window pattern, per-kind heads, per-layer embeddings, shared-KV "
                    "count); an uncapped config gets a cap of 0 written (the runtime's default is 30); E2B/E4B: a "
                    "layout whose shared KV llama.cpp reads from other blocks refused",
                    "`layer_types` sliced, `per_layer_config` re-keyed, `num_kv_shared_layers` recounted"),
    "gemma4_unified_text": ("not converted: llama.cpp's converter reads the multimodal checkpoint only "
                            "(Gemma4UnifiedForConditionalGeneration); not tested", "`layer_types` sliced, "
                            "`num_kv_shared_layers` recounted"),
    "minicpm3": ("converter knows it (not tested); reads its depth scale from the file's block count, as a reload "
                 "does", ""),
    "mixtral": ("runs (per-expert Hub layout written)", "per-expert Hub layout"),
    "qwen2_moe": ("runs when every block has experts; dense blocks among them refused", "`mlp_only_layers` recounted"),
    "qwen3_moe": ("runs when every block has experts; dense blocks among them refused", "`mlp_only_layers` recounted"),
    "olmoe": ("runs (per-expert Hub layout written)", "per-expert Hub layout"),
    "llama4_text": ("runs where the cut keeps experts on every step-th and RoPE-less blocks on every 4th block; "
                    "refused otherwise, and for chunks other than 8,192", "`moe_layers` renumbered, `no_rope_layers` sliced"),
    "gpt_oss": ("runs: kept layers' window pattern written", "`layer_types` sliced"),
    "qwen3_next": ("runs (told the export has no MTP head)", "`layer_types` sliced; no MTP head"),
    "qwen3_5_text": ("runs (its interleaved mRoPE sections read from the file)", "`layer_types` sliced"),
    "qwen3_5_moe_text": ("runs (with Qwen's vocabulary, as its checkpoints)", "`layer_types` sliced"),
    "lfm2": ("runs", "`layer_types` / `full_attn_idxs` recounted"),
    "granitemoehybrid": ("runs (the Hub's mamba/attention names written)", "the Hub's `layer_types` names"),
}


def family_section() -> list[str]:
    """The architecture table, as users meet it: what each operator does on each family, and where it serves."""
    from ghosted_core.architectures import ARCHITECTURES

    checks = (("magcomp", "scale"), ("replaceme", "branch"), ("refit", "down_proj"), ("kd_mlp", "mlp"))
    lines = ["## The families in the architecture table", "",
             "Every family runs the whole command line (`tests/model/test_models.py`: load, every criterion, "
             "calibration, every operator that applies, distillation, perplexity, generation, tasks, export, a fresh "
             "reload); ghost and the other residual-stream operators apply to all. A fold that does not apply is "
             "refused before any work with the reason (yes: the operator runs; stock where it folds, remote code "
             "otherwise).", "",
             "| model type | family | kind | " + " | ".join(name for name, _ in checks) + " | llama.cpp (GGUF) | vLLM |",
             "|---|---|---|" + "---|" * len(checks) + "---|---|"]
    for model_type, arch in ARCHITECTURES.items():
        cells = ["yes" if arch.refusal(need, name) is None else "no" for name, need in checks]
        gguf, vllm = SERVING.get(model_type, ("", ""))
        lines.append(f"| {model_type} | {arch.family} | {arch.kind} | {' | '.join(cells)} | {gguf} | {vllm} |")
    lines += ["", "Gemma 4: the 31B and 26B-A4B shapes run (wider heads on full-attention blocks, keys as values, experts "
              "beside the MLP); a cut keeps the last block, which transformers makes full attention on load. E2B and "
              "E4B run too (`ghosted_core/model/side_inputs.py`): each kept block keeps its slice of the per-layer "
              "embeddings (the export writes the kept slices), and the blocks that store the keys and values the last "
              "blocks reuse are kept by every criterion; prefix sharing and distillation start no later than the first "
              "of them; the criteria that run blocks one at a time from cached streams (sleb, kl, swap_kl, "
              "swap_kl_repl) carry each stream's stored keys and values and give each block its per-layer inputs. "
              "Refused for them with the reason: magcomp's scale (their blocks gate the per-layer embeddings with the "
              "raw stream).", "",
              "Multimodal checkpoints (`gemma3` 4B–27B, `gemma4`, `llama4`, `mistral3`, `qwen3_5`, …; `tests/model/test_multimodal.py`): "
              "the text decoder inside the wrapper is cut as its family above; the stock export is the whole checkpoint "
              "(vision tower and projector unchanged) and reloads as the same multimodal class. Remote-code saves of a "
              "wrapper are refused (the ghost operators' classes wrap text models).", "",
              "llama.cpp keys some facts to the block count or a layer's index (`ghosted_core/export/runtime_rules.py`, "
              "audited in the build's commit): the export writes or folds what a cut changes, or refuses with the "
              "reason. The vLLM column is what its loaders read from the config; the GPU test is ready "
              "(`tests/export/test_vllm_gpu.py`) and has not run on these families (no GPU was lent).", ""]
    return lines


def page(path: Path) -> str:
    results = json.loads(path.read_text())
    done = [r for r in results.values() if r["stage"] == "done"]
    reloaded = [r for r in done if r.get("reloads") and all(r["reloads"].values())]
    total = len(causal_types())
    tried = "" if len(results) >= total else f" (tried so far: {len(results)} of {total}; the bench resumes)"
    lines = ["# Which model types the studio cuts", "",
             f"**{len(done)} of the {len(results)} causal-LM types of transformers tried run the whole command line**"
             f"{tried} on a tiny random model built from their config's defaults, and {len(reloaded)} of them export "
             "folders that transformers reloads with the same greedy text (stock where the variant folds). The rest are "
             "listed with the first line of the reason they stopped: most are not decoder-only Llama-style stacks "
             "(encoders, GPT-2-style `transformer.h`), or their defaults do not run at a tiny size.", "",
             "```bash", ".venv/bin/python bench/families.py          # bench/results/families.json, resumable",
             ".venv/bin/python bench/families.py --page   # this page", "```", "",
             "In the architecture table means the folds (magcomp's scale, ReplaceMe's map) ran too; a type outside it "
             "runs the residual-stream operators (none, ghost_capped, …) and refuses the folds with the reason. "
             "Random weights: this is coverage, not quality.", "",
             *family_section(), "## Every causal-LM type of transformers", "",
             "| type | in the table | kind | runs | reload, same greedy text | reason |", "|---|---|---|---|---|---|"]
    for name in sorted(results):
        r = results[name]
        runs = "yes" if r["stage"] == "done" else f"no ({r['stage']})"
        reload = "" if r["stage"] != "done" else ("yes" if all(r.get("reloads", {}).values()) else
                                                 "no: " + ", ".join(k for k, v in r["reloads"].items() if not v))
        reason = r.get("reason", "").replace("|", "\\|").replace("\n", " ")[:160]
        lines.append(f"| {name} | {'yes' if r.get('in_table') else ''} | {r.get('kind', '')} | {runs} | {reload} | "
                     f"{reason} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=None, help="comma list (default: every causal-LM type)")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--out", default=None)
    parser.add_argument("--page", action="store_true", help="write docs/families.md from the results, run nothing")
    args = parser.parse_args()
    path = result_path("families", False, args.out)
    if args.page:
        PAGE.write_text(page(path))
        print(f"written {PAGE}")
        return
    types = [t.strip() for t in args.types.split(",")] if args.types else causal_types()
    run_all(types, path, args.timeout)
    print(f"written {path}")


if __name__ == "__main__":
    main()
