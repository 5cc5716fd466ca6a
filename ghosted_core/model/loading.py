"""Load a causal LM (embedded alias, local folder or Hub id), place it, and find its decoder blocks.

Weights go from the checkpoint straight to where they compute (`from_pretrained(device_map=…)`),
or to an accelerate device map with CPU/disk offload (`LoadOptions(device="map")`). Embedded
aliases resolve to their converted safetensors folder (`model.embedded`).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import convert_file_size_to_int
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from ghosted_core.data.assets import cache_dir
from ghosted_core.errors import GhostedError
from ghosted_core.hub import hub_reachable
from ghosted_core.model.embedded import DEFAULT_MODEL, EMBEDDED, converted_embedded, needs_conversion
from ghosted_core.memory import check_fits
from ghosted_core.model import hub_cache
from ghosted_core.architectures import architecture_of, families, stream_refusal
from ghosted_core.model.wrapper import is_wrapper_config, planning_config, text_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """How to place a model: straight onto one device, or an accelerate device map with offload.

    Weights go from the checkpoint to their target without a staging copy on the CPU:
    `from_pretrained(device_map=...)` materializes each tensor where it will live.
    """

    device: str = "auto"  # "auto" (cuda if present, else cpu), "cpu", "cuda", "cuda:N", or "map" (accelerate device_map="auto")
    dtype: str = "auto"  # "auto" (bf16 on GPU, fp32 on CPU), "float32", "bfloat16", "float16"
    max_memory: dict | None = None  # device="map": cap per device, e.g. {0: "20GiB", "cpu": "60GiB"}; the rest goes to disk
    offload_folder: str | None = None  # device="map": where weights that must be re-saved for disk offload go
    local_folders: bool = True  # False: a name never reads a folder of this machine (the app's default for strangers)
    # Hub access: None, huggingface_hub's own (this machine's login or HF_TOKEN: the command line); False, none
    # (anonymous); a string, that token (a Space visitor's own). Never shown in a repr.
    hub_token: str | bool | None = field(default=None, repr=False)
    # a model loaded from the Hub: refuse a download the disk cannot hold, and keep huggingface_hub's cache under
    # this many bytes afterwards, least recently used repositories first (None: neither; `model.hub_cache`)
    hub_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.device != "map" and (self.max_memory or self.offload_folder):
            raise GhostedError("--max_memory and --offload_folder apply to --device map only")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded causal LM and its tokenizer, with where they came from."""

    name: str  # what the user asked for: alias, folder or Hub id
    source: str  # "embedded", "local" or "hub"
    description: str
    model: PreTrainedModel
    tokenizer: object

    @property
    def num_layers(self) -> int:
        return len(decoder_blocks(self.model))

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)


def module_device(module: nn.Module) -> torch.device:
    """Where a module computes: its execution device under accelerate, else its first tensor's device."""
    hook = getattr(module, "_hf_hook", None)
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def model_placement(model: PreTrainedModel) -> tuple[str, torch.dtype]:
    """(device, dtype) of a loaded model as the memory plan names them: "map" when accelerate spread it."""
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "map", model.dtype
    return str(module_device(model.get_input_embeddings())), model.dtype


def decoder_blocks(model: PreTrainedModel) -> nn.ModuleList:
    """The list of decoder blocks of a causal LM whose layout we can cut (`check_layout`)."""
    check_layout(model)
    return model.model.layers


def final_norm(model: PreTrainedModel) -> nn.Module:
    """The norm after the blocks (its input is the stream a cut at the end maps): `final_norm_name`'s."""
    return getattr(model.model, final_norm_name(model))


def final_norm_name(model: PreTrainedModel) -> str:
    """The base model's attribute holding the norm after the blocks: the family's entry names it; for a type the
    table lacks whose base has no `norm`, its one child norm module (Bamba's `final_layernorm`), if it has one (on a
    variant, also where a boundary operator wraps it: `PatchedBlock.inner`)."""
    arch = architecture_of(model.config)
    base = getattr(model, "model", None)
    if not arch.generic or base is None or getattr(base, arch.final_norm, None) is not None:
        return arch.final_norm
    norms = [name for name, child in base.named_children()  # a variant's norm may be patched: the norm inside
             if type(getattr(child, "inner", child)).__name__.endswith(("Norm", "NormGated"))]
    return norms[0] if len(norms) == 1 else arch.final_norm


def check_supported(config: PretrainedConfig) -> None:
    """Refuse, from the config alone, what is not a decoder-only causal LM with a stack of blocks."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    reason = None
    if getattr(config, "is_encoder_decoder", False):
        reason = "an encoder-decoder model (only decoder-only models have one residual stream through their blocks)"
    elif is_wrapper_config(config):
        check_supported(config.get_text_config())  # its decoder is cut as the text model it is
        try:
            check_layout(_skeleton(config))
        except ValueError as err:  # no decoder at model.language_model.layers
            reason = f"a multimodal checkpoint laid out otherwise ({err})"
    elif getattr(config, "text_config", None) is not None:
        reason = "a multimodal type that transformers does not build as image-text-to-text"
    elif model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        reason = "not a causal LM that transformers can build"
    elif not isinstance(getattr(config, "num_hidden_layers", None), int):
        reason = "its config has no num_hidden_layers"
    elif (several := stream_refusal(config)) is not None:
        reason = several
    if reason:
        raise GhostedError(f"unsupported architecture {model_type!r}: {reason}; Ghosted Layers cuts decoder-only "
                           f"causal LMs (in the architecture table, {families()}; others run the residual-stream "
                           "operators only)")
    if not is_wrapper_config(config):
        check_layout(_skeleton(config))


def _skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The model's module tree on the meta device (no weights, no memory): where its parts are, before loading
    (a multimodal checkpoint's: its text view)."""
    if is_wrapper_config(config):
        from transformers import AutoModelForImageTextToText

        with torch.device("meta"):
            return text_view(AutoModelForImageTextToText.from_config(config))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_layout(model: PreTrainedModel) -> None:
    """Refuse a model whose blocks and final norm are not where a cut looks for them (`model.layers`, the final
    norm its table entry names), with what was found instead, or whose `lm_head` is not its vocabulary projection."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    norm = final_norm_name(model)
    if not isinstance(layers, nn.ModuleList) or getattr(base, norm, None) is None:
        found = ", ".join(name for name, _ in (base or model).named_children()) or "nothing"
        raise GhostedError(f"unsupported architecture {model.config.model_type!r}: no decoder blocks at model.layers "
                           f"with a final norm model.{norm} (found {found}); Ghosted Layers cuts decoder-only causal "
                           f"LMs laid out as transformers' Llama-style models are (the architecture table has "
                           f"{families()})")
    head, projection = getattr(model, "lm_head", None), model.get_output_embeddings()
    if head is None or projection is not head:  # ModernBERT-decoder: a dense layer and a norm, then `decoder`
        raise GhostedError(f"unsupported architecture {model.config.model_type!r}: its LM head "
                           f"({type(head).__name__}) runs layers before the vocabulary projection "
                           f"({type(projection).__name__}), and the studio's perplexity, distillation targets and "
                           "next-token criteria apply lm_head as that projection; not supported yet")


def resolve_dtype(dtype: str, device: str, model: str | None = None) -> torch.dtype:
    """fp32 on CPU and bf16 on GPU unless the user says otherwise; "auto" keeps an embedded model's stored dtype
    where it is narrower than fp32 (the 1.5B is stored in bf16: fp32 would double its memory and quadruple its time)."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype in (None, "auto"):
        if device.startswith("cuda") or device == "map" and torch.cuda.is_available():
            return torch.bfloat16
        return EMBEDDED[model].dtype if model in EMBEDDED else torch.float32
    if dtype not in names:
        raise GhostedError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
    return names[dtype]


def resolve_device(device: str) -> str:
    """'auto' becomes 'cuda' when a GPU is present, else 'cpu'; a GPU asked for but absent is an error."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GhostedError(f"device {device!r} asked for, but no CUDA GPU is visible; use --device cpu")
    if device != "map" and not device.startswith(("cpu", "cuda")):
        raise GhostedError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or map (accelerate offload)")
    return device


def parse_max_memory(text: str | None) -> dict | None:
    """'0=20GiB,cpu=60GiB' → {0: 21474836480, "cpu": 64424509440} (accelerate's max_memory, in bytes).

    Keys: a GPU index, `cpu` or `disk`; sizes: bytes, or a number with KB/MB/GB or KiB/MiB/GiB.
    None or '' → None (accelerate's own defaults).
    """
    if not text or not text.strip():
        return None
    caps: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, size = (s.strip() for s in part.partition("="))
        try:
            if not sep or not (key.isdigit() or key.lower() in {"cpu", "disk"}):
                raise ValueError(part)
            value = int(size) if size.isdigit() else convert_file_size_to_int(size)
            if value <= 0:
                raise ValueError(part)
        except (ValueError, OverflowError):  # OverflowError: a size such as 1e999GiB
            raise GhostedError(f"cannot read --max_memory {text!r}: write DEVICE=SIZE pairs such as 0=20GiB,cpu=60GiB "
                               "(DEVICE: a GPU index, cpu or disk)") from None
        caps[int(key) if key.isdigit() else key.lower()] = value
    return caps


def default_offload_folder(name: str) -> Path:
    """`cache_dir()/offload/<model>`: used only for weights that cannot be read from their safetensors file."""
    return cache_dir() / "offload" / re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def check_load_options(options: LoadOptions) -> tuple[str, torch.dtype]:
    """The resolved (device, dtype), refusing what cannot work before anything is read."""
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    if device != "map" and (options.max_memory or options.offload_folder):
        raise GhostedError("--max_memory and --offload_folder apply to --device map only")
    return device, dtype


def placement(name: str, options: LoadOptions) -> dict:
    """Keyword arguments of `from_pretrained` that put the weights where `options` says, in one step.

    One device: `device_map=<device>` loads each tensor straight onto it (no whole-model copy
    on the CPU first). `map`: accelerate's `device_map="auto"` fills GPUs, then the CPU, up to
    `max_memory`, and leaves the rest on disk, read block by block during each forward pass.
    """
    device, _ = check_load_options(options)
    dtype = resolve_dtype(options.dtype, device, name)
    if device != "map":
        return {"dtype": dtype, "device_map": device}
    folder = Path(options.offload_folder) if options.offload_folder else default_offload_folder(name)
    return {"dtype": dtype, "device_map": "auto", "max_memory": options.max_memory, "offload_folder": str(folder)}


HUB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")  # one part of org/name (the Hub's rules)


def is_hub_id(name: str) -> bool:
    """`org/name` as the Hub spells repository ids: letters, digits, '-', '_', '.', no '--' or '..', no path."""
    parts = name.split("/")
    return len(parts) == 2 and all(HUB_NAME.fullmatch(p) and "--" not in p and ".." not in p for p in parts)


def _locate(name: str, local_folders: bool = True) -> tuple[str, str, str]:
    """(source, folder or hub id, description) for what the user typed.

    `local_folders=False`: the disk is never looked at for `name` (only embedded models and Hub ids).
    """
    if name in EMBEDDED:
        spec = EMBEDDED[name]
        return "embedded", str(converted_embedded(spec)), spec.description
    path = Path(name).expanduser()
    if local_folders and path.is_dir():
        if not (path / "config.json").exists():
            raise GhostedError(f"{name} is a folder without config.json; point at a saved Hugging Face model folder")
        return "local", str(path), f"local folder {path}"
    if is_hub_id(name):
        if not hub_reachable():
            raise GhostedError(
                f"{name} looks like a Hugging Face Hub id, but the Hub is not reachable from here; "
                f"use a local model folder or an embedded model ({', '.join(EMBEDDED)})"
            )
        return "hub", name, f"Hugging Face Hub model {name}"
    folders = "a local folder, " if local_folders else ""
    raise GhostedError(
        f"unknown model {name!r}: not an embedded model ({', '.join(EMBEDDED)}), {folders}or a Hub id (org/name: "
        "letters, digits, '-', '_' and '.', without a path)"
    )


def _gated(name: str) -> str:
    return (f"{name} is a gated model on the Hugging Face Hub: request access at https://huggingface.co/{name} "
            "and log in (hf auth login or HF_TOKEN)")


def _not_found(name: str, instead: str) -> str:
    return (f"{name} is not a model on the Hugging Face Hub (or it is private and you are not logged in); check "
            f"the id, or use {instead}")


@contextlib.contextmanager
def _readable(name: str) -> Iterator[None]:
    """Turn what transformers raises for an unusable model (missing, gated, custom code, unreadable) into one line."""
    try:
        yield
    except SafetensorError as err:  # a weights file cut short (an interrupted copy or download) or not safetensors
        raise GhostedError(f"cannot read {name}: a weights file is damaged or incomplete ({err}); copy or download "
                           "the model again") from None
    except (OSError, ValueError) as err:
        cause, text = err.__cause__, str(err)
        if isinstance(cause, GatedRepoError) or isinstance(err, GatedRepoError):
            raise GhostedError(_gated(name)) from None
        if isinstance(cause, RepositoryNotFoundError) or isinstance(err, RepositoryNotFoundError):
            raise GhostedError(_not_found(name, "a local folder or an embedded model")) from None
        if "trust_remote_code" in text or "custom code" in text:
            raise GhostedError(f"{name} needs its own modelling code (trust_remote_code), which Ghosted Layers does "
                               f"not run; use a checkpoint of a family transformers ships (the architecture table has {families()})") from None
        if "does not recognize this architecture" in text:
            raise GhostedError(f"unsupported architecture in {name}: this transformers version does not know it") from None
        if isinstance(err, OSError):
            first = next((line for line in text.splitlines() if line.strip()), type(err).__name__)
            raise GhostedError(f"cannot read {name}: {first}") from None
        raise


HUB_CONFIG_FILES = ("config.json",)
HUB_MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt")  # no .bin, no .gguf


def _hub_guarded(name: str, call):
    """`call()`, with what the Hub raises for `name` turned into one line (as `_hub_snapshot` does)."""
    try:
        return call()
    except GhostedError:
        raise
    except GatedRepoError:
        raise GhostedError(_gated(name)) from None
    except RepositoryNotFoundError:
        raise GhostedError(_not_found(name, "an embedded model")) from None
    except Exception as err:  # offline, a refused connection, a full disk: one line
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise GhostedError(f"cannot download {name} from the Hugging Face Hub ({type(err).__name__}: {first})") from None


def _hub_snapshot(name: str, patterns: tuple[str, ...], token: str | bool | None = None) -> str:
    """The files `patterns` of Hub repo `name`, downloaded into (or found in) huggingface_hub's cache; the folder.

    A name typed where local folders are off resolves here, never through the working directory:
    `from_pretrained("org/name")` would load a folder `./org/name` first if one existed.
    """
    from huggingface_hub import snapshot_download

    return _hub_guarded(name, lambda: snapshot_download(repo_id=name, repo_type="model",
                                                        allow_patterns=list(patterns), token=token))


def _read_config(name: str, where: str) -> PretrainedConfig:
    with _readable(name):
        config = AutoConfig.from_pretrained(where, trust_remote_code=False)  # never run a repository's own code
    check_supported(config)
    return config


def peek_config(name: str, local_folders: bool = True, token: str | bool | None = None) -> PretrainedConfig:
    """The config of `name` without loading its weights, checked to be a supported architecture (`token`: Hub
    access, as `LoadOptions.hub_token`)."""
    if name in EMBEDDED and EMBEDDED[name].config and needs_conversion(name):  # known without a 1 GB download
        config = AutoConfig.for_model(**dict(EMBEDDED[name].config))
        check_supported(config)
        return config
    source, where, _description = _locate(name, local_folders)
    if source == "hub" and (not local_folders or token is not None):
        where = _hub_snapshot(name, HUB_CONFIG_FILES, token)
    return planning_config(_read_config(name, where))


def max_positions(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's position embeddings cover (None: no limit stated)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def load_model(name: str = DEFAULT_MODEL, options: LoadOptions = LoadOptions()) -> LoadedModel:
    """Load `name` (alias, local folder or Hub id) for inference, checked to be a supported architecture.

    The weights go straight to where they will compute (see `placement`): bf16 on a GPU, fp32
    on the CPU unless `options.dtype` says otherwise.
    """
    device = resolve_device(options.device)
    kwargs = placement(name, options)
    source, where, description = _locate(name, options.local_folders)
    # through the Hub's cache, never a folder named `name`, and with the token asked for
    from_hub = source == "hub" and (not options.local_folders or options.hub_token is not None)
    config = _read_config(name, _hub_snapshot(name, HUB_CONFIG_FILES, options.hub_token) if from_hub else where)
    if source == "hub":
        check_fits(planning_config(config), device, kwargs["dtype"], name)
    if from_hub:
        if options.hub_cache_bytes is not None:
            _hub_guarded(name, lambda: hub_cache.check_room(name, HUB_MODEL_FILES, options.hub_token))
        where = _hub_snapshot(name, HUB_MODEL_FILES, options.hub_token)
        if options.hub_cache_bytes is not None:
            hub_cache.trim(options.hub_cache_bytes, keep=name)
    with _readable(name):
        if is_wrapper_config(config):  # the whole checkpoint loads; its text decoder is what gets cut
            from transformers import AutoModelForImageTextToText

            model = text_view(AutoModelForImageTextToText.from_pretrained(where, trust_remote_code=False, **kwargs))
        else:
            model = AutoModelForCausalLM.from_pretrained(where, trust_remote_code=False, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
    model.eval()
    model.requires_grad_(False)
    where_to = f"device map {getattr(model, 'hf_device_map', {})}" if device == "map" else device
    log.info("loaded %s (%s, %d blocks, hidden %d, %s on %s)", name, source, model.config.num_hidden_layers,
             model.config.hidden_size, str(kwargs["dtype"]).removeprefix("torch."), where_to)
    return LoadedModel(name=name, source=source, description=description, model=model, tokenizer=tokenizer)
