"""Export a pruned or recovered variant as a folder that loads without ghosted_core.

Two formats, chosen per variant (`mode="auto"`) or asked for:
- **stock**: a plain Hugging Face checkpoint of the same architecture class with fewer
  `num_hidden_layers` (per-layer config lists sliced), ReplaceMe's map folded into the
  down_proj of the block before each cut, tied embeddings still tied. Plain transformers and
  serving engines load it. Possible for plain pruning, the replaceme family and magcomp (the
  operators registered `stock=True`; see `fold`).
- **remote_code**: the variant's own module tree, with `modeling_ghosted.py` (self-contained)
  registered through `auto_map`; `AutoModelForCausalLM.from_pretrained(folder,
  trust_remote_code=True)` loads it. Its model type (`ghosted_llama`, …) is not a stock one,
  so loading it without remote code fails loudly instead of loading random blocks.

Every export also holds the tokenizer, the generation config, a model card (README.md) and
`ghosted.json` (the variant's record). No file names a path of the machine that wrote it.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ghosted_core.architectures import architecture_of
from ghosted_core.model import modeling_ghosted
from ghosted_core.model.wrapper import from_wrapper, wrapped, wrapper_export_config
from ghosted_core.data.assets import cache_dir
from ghosted_core.export.checkpoint import DEFAULT_SHARD_BYTES, WEIGHTS, WEIGHTS_INDEX, ShardWriter, export_config, \
    write_json
from ghosted_core.errors import GhostedError
from ghosted_core.files import is_no_room, no_room_error, staged_file
from ghosted_core.export.fold import operator_layout, stock_blockers, stock_tensors, variant_tensors
from ghosted_core.hub import hub_reachable
from ghosted_core.export.model_card import model_card
from ghosted_core.recovery.operators import OPERATORS, get_operator

log = logging.getLogger(__name__)

EXPORT_MODES = ("auto", "stock", "remote_code")
MODELING_FILE = "modeling_ghosted.py"
RECORD_FILE = "ghosted.json"
CONFIG_PENDING = ".config.json.pending"  # config.json until the folder is in place (see export_variant)


@dataclass(frozen=True)
class ExportResult:
    """What `export_variant` wrote, and why in that format."""

    folder: Path
    mode: str  # "stock" or "remote_code"
    variant: str  # the variant's name (operator, "+seq" for the sequential fit)
    reason: str  # what folded, or why it could not
    files: tuple[str, ...]
    weight_bytes: int
    archive: Path | None = None  # the zip, for archive_export
    gguf: Path | None = None  # the GGUF file in the folder, for export.gguf.export_gguf

    def to_json(self) -> dict:
        return {"folder": str(self.folder), "mode": self.mode, "variant": self.variant, "reason": self.reason,
                "files": list(self.files), "weight_bytes": self.weight_bytes,
                "archive": None if self.archive is None else str(self.archive),
                "gguf": None if self.gguf is None else str(self.gguf)}


def _record(model: PreTrainedModel) -> dict:
    record = dict(getattr(model.config, "ghosted", None) or {})
    if not record:
        raise GhostedError("only pruned variants built by ghosted_core can be exported (no 'ghosted' record in the config)")
    return record


def variant_name(record: dict) -> str:
    return record.get("variant") or record.get("operator", "variant") + ("+seq" if record.get("sequential") else "")


def choose_mode(model: PreTrainedModel, mode: str = "auto") -> tuple[str, str]:
    """(format, reason): stock where the variant folds, remote_code otherwise (or as asked)."""
    if mode not in EXPORT_MODES:
        raise GhostedError(f"unknown export format {mode!r}; use one of {', '.join(EXPORT_MODES)}")
    blockers = stock_blockers(model)
    if wrapped(model) is not None and (blockers or mode == "remote_code"):
        raise GhostedError(f"{variant_name(_record(model))}: {MULTIMODAL_STOCK_ONLY}"
                           + (f" (this variant does not fold: {blockers[0]})" if blockers else ""))
    if blockers and mode == "stock":
        raise GhostedError(f"{variant_name(_record(model))} cannot be exported as a stock checkpoint: {blockers[0]}; "
                           "use --export remote_code (or auto)")
    if blockers:
        return "remote_code", blockers[0]
    if mode == "remote_code":
        return "remote_code", "remote code was asked for (this variant would also fold into a stock checkpoint)"
    record = _record(model)
    operator = record.get("operator", "none")
    fold = get_operator(operator).fold if operator in OPERATORS else ""
    reason = fold or f"{operator}'s variant folds into stock weights"
    if record.get("distill"):
        reason += f"; distillation then trained {record['distill']['description']}, weights a stock checkpoint has"
    return "stock", reason


MULTIMODAL_STOCK_ONLY = ("a multimodal checkpoint exports as stock only (the remote-code classes wrap text models, "
                         "and a text-only folder would drop the vision tower): save the stock operators (none, the "
                         "replaceme family, magcomp, the refits) with --export stock or auto")


def check_export(operators: Sequence[str], mode: str, config=None) -> None:
    """Refuse, before any work, an export format that the requested operators cannot have (`config`: the model's,
    as `peek_config` gives it; a multimodal checkpoint's exports are stock only, so an operator that does not fold
    on its family is refused too)."""
    if mode not in EXPORT_MODES:
        raise GhostedError(f"unknown export format {mode!r}; use one of {', '.join(EXPORT_MODES)}")
    never = [name for name in dict.fromkeys(operators) if not get_operator(name).stock]
    multimodal = config is not None and from_wrapper(config)
    if multimodal and not architecture_of(config).branch_folds:  # ReplaceMe's map passes a norm: remote code
        never += [name for name in dict.fromkeys(operators) if "branch" in get_operator(name).requires
                  and name not in never]
    if multimodal and (never or mode == "remote_code"):
        raise GhostedError(f"--save_model: {MULTIMODAL_STOCK_ONLY}" + (f"; not {', '.join(never)}" if never else ""))
    if mode == "stock" and never:
        raise GhostedError(f"--export stock: {', '.join(never)} cannot fold into a stock checkpoint (a map on the whole "
                           "residual stream); use --export remote_code or auto, or only the stock operators "
                           f"({', '.join(name for name, spec in OPERATORS.items() if spec.stock)})")


def _expected_keys(model: PreTrainedModel, config_values: dict, remote: bool) -> set[str]:
    """State-dict keys transformers will look for when it loads the exported config (built on meta)."""
    outer = wrapped(model)
    if remote:
        config_cls, model_cls = modeling_ghosted.ghosted_classes(model.config.model_type)
    elif outer is not None:  # the multimodal checkpoint the text view stands for
        config_cls, model_cls = type(outer.module.config), type(outer.module)
    else:
        config_cls, model_cls = type(model.config), type(model)
    config = config_cls.from_dict({k: v for k, v in config_values.items() if k not in ("auto_map", "model_type")})
    with torch.device("meta"):
        skeleton = model_cls(config)
    if remote:
        keys = set(skeleton.state_dict())
    else:
        skeleton._weight_conversions = getattr(outer.module if outer else model, "_weight_conversions", None)
        keys = set(hub_layout(skeleton, skeleton.state_dict()))
    if getattr(config, "tie_word_embeddings", False):
        keys.discard("lm_head.weight")
    return keys


def hub_layout(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (one block's, or the rest) under the names and layout of the model's checkpoints on the Hub:
    transformers' own reversal of what it converts at load time (per-expert weights that it fuses, renamed
    modules), as its `save_pretrained` does. vLLM and llama.cpp's converter read that layout (Mixtral's
    `experts.N.w1`, OLMoE's per-expert projections, GraniteMoeHybrid's `input_linear`), not the fused one."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _write_weights(model: PreTrainedModel, folder: Path, remote: bool, shard_bytes: int) -> tuple[list[str], int, set[str]]:
    writer = ShardWriter(folder, shard_bytes)
    keys: set[str] = set()
    outer = None if remote else wrapped(model)
    chunks = variant_tensors(model) if remote else stock_tensors(model)
    if outer is not None:  # the cut decoder under the wrapper's names, then the wrapper's other parts unchanged
        chunks = itertools.chain(({outer.key(k): v for k, v in chunk.items()} for chunk in chunks),
                                 outer.other_tensors())
    for chunk in chunks:
        chunk = chunk if remote else hub_layout(outer.module if outer else model, chunk)
        keys |= set(chunk)
        writer.add(chunk)
    return writer.close(), writer.total_bytes, keys


def _config_values(model: PreTrainedModel, record: dict, remote: bool) -> dict:
    architecture = type(model).__name__
    if not remote:
        values = export_config(model.config, record, architectures=[architecture])
        outer = wrapped(model)
        return values if outer is None else wrapper_export_config(outer, values)
    model_type = model.config.model_type
    config_cls, model_cls = modeling_ghosted.ghosted_classes(model_type)
    module = Path(MODELING_FILE).stem
    return export_config(model.config, record, model_type=config_cls.model_type, architectures=[model_cls.__name__],
                         auto_map={"AutoConfig": f"{module}.{config_cls.__name__}",
                                   "AutoModelForCausalLM": f"{module}.{model_cls.__name__}"},
                         ghosted_layout=operator_layout(model))


def keep_what_converters_read(tokenizer, folder: Path) -> None:
    """The source's tokenizer facts that transformers 5 does not save and llama.cpp's converter reads: the
    sentencepiece model (transformers saves only tokenizer.json, and the source file's absolute path in
    tokenizer_config.json, which would name this machine's folders; Gemma-2, Phi-3 and other sentencepiece families
    read tokenizer.model), and the source's tokenizer class where transformers writes its generic backend instead
    (Phi-4-mini ships "GPT2Tokenizer", which tells the Phi-3 converter to read a BPE vocabulary, not tokenizer.model)."""
    source = getattr(tokenizer, "vocab_file", None)
    if source and Path(source).name == "tokenizer.model" and Path(source).is_file() \
            and not (folder / "tokenizer.model").exists():
        shutil.copyfile(source, folder / "tokenizer.model")
    settings = folder / "tokenizer_config.json"
    values = json.loads(settings.read_text()) if settings.exists() else {}
    changed = values.pop("vocab_file", None) is not None  # the copy beside it is what a loader finds
    if values.get("tokenizer_class") == GENERIC_TOKENIZER_CLASS:
        named = source_tokenizer_class(tokenizer)
        if named and named != GENERIC_TOKENIZER_CLASS:
            values["tokenizer_class"], changed = named, True
    if changed:
        settings.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


GENERIC_TOKENIZER_CLASS = "TokenizersBackend"  # what transformers 5 writes for a tokenizer.json-backed tokenizer


def source_tokenizer_class(tokenizer) -> str | None:
    """The tokenizer class named by the tokenizer_config.json `tokenizer` was loaded from (a local folder or the
    Hub cache; nothing is downloaded), or None."""
    from transformers.utils import cached_file

    source = str(getattr(tokenizer, "name_or_path", "") or "")
    if not source:
        return None
    try:
        path = cached_file(source, "tokenizer_config.json", local_files_only=True,
                           _raise_exceptions_for_missing_entries=False)
        return json.loads(Path(path).read_text()).get("tokenizer_class") if path else None
    except (OSError, ValueError):
        return None


def _local_paths(model: PreTrainedModel, folder: Path) -> set[str]:
    """Paths of this machine that must not appear in an export."""
    paths = {str(folder.resolve().parent), str(cache_dir().resolve()), str(Path.home()) + "/"}
    source = str(getattr(model.config, "_name_or_path", "") or "")
    if source and Path(source).expanduser().exists():
        paths.add(str(Path(source).expanduser().resolve()))
    return {p for p in paths if len(p) > 1}


def _check_no_paths(folder: Path, paths: set[str]) -> None:
    for file in folder.iterdir():
        if file.suffix == ".safetensors":
            continue
        text = file.read_text(errors="replace")
        leaked = [p for p in paths if p in text and not (file.name == "tokenizer.json" and p.endswith("/"))]
        if leaked:
            raise RuntimeError(f"export file {file.name} names a local path ({leaked[0]}); refusing to write it")


def export_variant(model: PreTrainedModel, tokenizer, folder: str | Path, mode: str = "auto",
                   shard_bytes: int = DEFAULT_SHARD_BYTES) -> ExportResult:
    """Write `model` (a variant built by ghosted_core) to `folder` as a stock or remote-code checkpoint.

    `mode`: "auto" (stock where the variant folds, remote_code otherwise), "stock" (refused
    with the reason when it does not fold) or "remote_code". Weights are written block by
    block in shards of ≤ `shard_bytes`, read from the offload when accelerate offloaded them.
    The folder is staged beside `folder` under a hidden name and moved into place once complete;
    its config.json gets that name last, once the folder is in place, so whatever a crash (even
    SIGKILL) leaves behind loads nowhere. `ghosted.json` lists every other file with its size
    (`check_export_folder`). A full disk gives one `GhostedError` and leaves nothing behind.
    """
    folder = Path(folder)
    record = _record(model)
    chosen, reason = choose_mode(model, mode)
    remote = chosen == "remote_code"
    architecture = type(model).__name__
    name = variant_name(record)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}-") as tmp:
            staged = Path(tmp) / "model"
            staged.mkdir()
            weight_files, weight_bytes, keys = _write_weights(model, staged, remote, shard_bytes)
            config_values = _config_values(model, record, remote)
            expected = _expected_keys(model, config_values, remote)
            if keys != expected:  # a bug: transformers would warn and initialise the difference at random
                raise RuntimeError(f"exported keys do not match the {chosen} model: missing "
                                   f"{sorted(expected - keys)[:3]}, unexpected {sorted(keys - expected)[:3]}")
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(staged)
            if tokenizer is not None:
                tokenizer.save_pretrained(staged)
                keep_what_converters_read(tokenizer, staged)
            if remote:
                shutil.copyfile(modeling_ghosted.__file__, staged / MODELING_FILE)
            clean_record = {k: v for k, v in record.items() if k != "layout"}
            (staged / "README.md").write_text(model_card(clean_record, chosen, reason, architecture))
            manifest = {p.name: p.stat().st_size for p in sorted(staged.iterdir())}
            write_json(staged / RECORD_FILE, clean_record | {"export": {"mode": chosen, "reason": reason,
                                                                        "files": manifest}})
            write_json(staged / CONFIG_PENDING, config_values)  # named config.json last: nothing loads it before
            _check_no_paths(staged, _local_paths(model, folder))
            if folder.exists():
                shutil.rmtree(folder)
            staged.rename(folder)
            (folder / CONFIG_PENDING).rename(folder / "config.json")
            files = tuple(sorted(p.name for p in folder.iterdir()))
    except OSError as err:
        if is_no_room(err):
            raise no_room_error(err, f"the {name} export", folder.parent) from None
        raise
    log.info("exported %s as %s (%s) to %s: %d weight file(s), %.1f MB", name, chosen, reason, folder,
             len(weight_files), weight_bytes / 1e6)
    return ExportResult(folder, chosen, name, reason, files, weight_bytes)


def zip_export(folder: str | Path, path: str | Path, suffix: str = "") -> Path:
    """One uncompressed zip of an exported folder (fp32 weights barely compress), its files under `path`'s stem;
    with `suffix` (".gguf"), only the files whose names end with it."""
    folder, path = Path(folder), Path(path)
    with staged_file(path, f"the zip {path.name}") as staged:  # a failed or interrupted zip leaves no file
        with zipfile.ZipFile(staged, "w", compression=zipfile.ZIP_STORED) as archive:
            for file in sorted(folder.rglob("*")):
                if file.is_file() and file.name.endswith(suffix):
                    archive.write(file, Path(path.stem) / file.relative_to(folder))
    return path


def archive_export(model: PreTrainedModel, tokenizer, path: str | Path, mode: str = "auto") -> ExportResult:
    """`export_variant` straight into a zip at `path` (for downloads); the folder is not kept.

    The zip holds one folder named after the zip's stem; the result's `folder` is that name.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.stem}-") as tmp:
            result = export_variant(model, tokenizer, Path(tmp) / path.stem, mode)
            zip_export(result.folder, path)
    except OSError as err:
        if is_no_room(err):
            raise no_room_error(err, f"the zip {path.name}", path.parent) from None
        raise
    return replace(result, folder=Path(path.stem), archive=path)


def archive_recovered(model: PreTrainedModel, tokenizer, path: str | Path) -> Path:
    """The zip of `archive_export` in auto mode (stock where the variant folds); kept for the app."""
    return archive_export(model, tokenizer, path).archive


def check_export_folder(folder: str | Path) -> dict:
    """The config of a complete export; GhostedError for a partial one (interrupted, truncated) or no export at all.

    An export writes config.json last and lists every other file with its size in ghosted.json,
    so a folder a crash left behind, or one copied only in part, is refused here with what is missing
    (every listed file must be there; weight files must also have their size).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise GhostedError(f"{folder} is not an exported model folder (no such folder)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise GhostedError(f"{folder} is not a complete exported model: it has no config.json (an export writes it "
                           "last, so this is an interrupted export or no export at all); export it again")
    try:
        config = json.loads(config_file.read_text())
        record = json.loads((folder / RECORD_FILE).read_text()) if (folder / RECORD_FILE).is_file() else {}
    except (OSError, ValueError) as err:
        raise GhostedError(f"{folder} is not a complete exported model: {err}; export it again") from None
    if "ghosted" in config:
        raise GhostedError(f"{folder} was written in an earlier Ghosted Layers format that plain transformers cannot "
                           "load; run the pruning again and export it (--save_model)")
    expected = dict(record.get("export", {}).get("files", {}))
    index = folder / WEIGHTS_INDEX
    if not expected and index.is_file():  # an export older than the manifest: at least every shard must be there
        expected = dict.fromkeys(json.loads(index.read_text()).get("weight_map", {}).values())
    elif not expected:
        expected = {WEIGHTS: None}
    for name, size in expected.items():
        path = folder / name
        size = size if name.endswith((".safetensors", ".index.json")) else None  # a model card may be edited
        if not path.is_file() or size is not None and path.stat().st_size != size:
            state = "missing" if not path.is_file() else f"{path.stat().st_size:,} of {size:,} bytes"
            raise GhostedError(f"{folder} is an incomplete export: {name} is {state}; export it again")
    return config


def export_mode(folder: str | Path) -> str:
    """"stock" or "remote_code" for a complete exported folder (GhostedError if it is not one, or only part of one)."""
    config = check_export_folder(folder)
    return "remote_code" if "auto_map" in config and str(config.get("model_type", "")).startswith("ghosted_") else "stock"


def load_recovered(folder: str | Path, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) of an export. Remote-code folders are loaded with ghosted_core's own copy
    of the modeling code, so the folder's code is never executed."""
    folder = Path(folder)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if export_mode(folder) == "remote_code":
        model_type = json.loads((folder / "config.json").read_text())["model_type"]
        try:
            _config_cls, model_cls = modeling_ghosted.ghosted_classes(model_type)
        except KeyError:
            raise GhostedError(f"{folder} has an unknown Ghosted model type {model_type!r}") from None
        model = model_cls.from_pretrained(folder, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    model.to(device).eval().requires_grad_(False)
    if (folder / RECORD_FILE).exists():  # the variant's record, as the in-memory variant had it
        model.config.ghosted = {k: v for k, v in json.loads((folder / RECORD_FILE).read_text()).items() if k != "export"}
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").exists() else None
    return model, tokenizer


def upload_export(folder: str | Path, repo_id: str, token: str, private: bool = False) -> str:
    """Upload an exported folder (with its model card) to a new Hub model repo; returns its URL.

    The token is passed to huggingface_hub only: never logged, stored or put in a message.
    """
    folder = Path(folder)
    export_mode(folder)  # refuses what is not an export
    if not token or not token.strip():
        raise GhostedError("uploading needs a Hugging Face write token")
    if not repo_id or repo_id.count("/") > 1 or not repo_id.strip("/"):
        raise GhostedError(f"{repo_id!r} is not a Hub repo id (name or org/name)")
    if not hub_reachable():
        raise GhostedError("the Hugging Face Hub is not reachable from here, so nothing can be uploaded")
    from huggingface_hub import HfApi

    api = HfApi(token=token.strip())
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=False)
        api.upload_folder(folder_path=str(folder), repo_id=url.repo_id, repo_type="model",
                          commit_message="Upload a model exported by Ghosted Layers Studio")
    except Exception as err:  # the Hub's answer, offline mode, a refused or dropped connection: one message each
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        message = f"{type(err).__name__}: {first}" if first else type(err).__name__
        raise GhostedError(f"upload to {repo_id} failed ({message.replace(token.strip(), '***')}); nothing was "
                           "pushed, or only part of the folder: check the repo on the Hub, then push again to a "
                           "new name") from None
    log.info("uploaded %s to %s", folder.name, url)
    return str(url)
