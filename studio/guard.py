"""What a stranger may ask of the server: widget values held to the page's own ranges, model names to the folder setting.

The page's sliders and dropdowns bound what a browser sends, but the API takes any JSON: NaN,
10⁹ or a string where the slider gives 1–128, a prompt of megabytes, a model name that is a
path on the server. `studio.runner.build_options` passes every value through here first, so a
hostile request gets one clear message (gr.Error) before any work, never a traceback.

Local model folders are off unless the server's operator turns them on with
GHOSTED_APP_LOCAL_MODELS: `1` opens every folder of the machine (what `make app` sets on
one's own machine), a folder path opens the model folders inside it only, unset or `0` opens
none (a Space, the Docker image). With folders off, a name is never looked up on disk.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ghosted_core.errors import GhostedError
from ghosted_core.model.embedded import EMBEDDED
from ghosted_core.model.loading import is_hub_id

LOCAL_MODELS_ENV = "GHOSTED_APP_LOCAL_MODELS"
MODEL_CHARS = 300  # the longest model name (Hub id or folder) a request may give
PROMPT_CHARS = 2000  # the longest prompt: generation runs every variant on it, on a shared server
FIELD_CHARS = 200  # block lists, depth ranges, repo ids, tokens


def local_folders() -> Path | bool:
    """The operator's setting: False (off), True (every folder) or the folder whose model folders are open."""
    value = os.environ.get(LOCAL_MODELS_ENV, "").strip()
    if value.lower() in ("", "0", "off", "false", "no"):
        return False
    if value.lower() in ("1", "on", "true", "yes"):
        return True
    return Path(value).expanduser().resolve()


def local_folders_note() -> str:
    """What the page says about local folders on this server."""
    setting = local_folders()
    if setting is False:
        return (f"Local model folders are **off** on this server (its operator can turn them on with "
                f"{LOCAL_MODELS_ENV}=1).")
    if setting is True:
        return "Local model folders are **on**: any folder of this machine can be typed in the Model box."
    return f"Local model folders are **on** for the folders inside `{setting}` only."


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~", "file:")) or "\\" in name or ("/" in name and not is_hub_id(name))


def model_name(value: object) -> tuple[str, bool]:
    """(model name, whether it may be read as a local folder); GhostedError for what this server does not open."""
    name = text(value, "Model", MODEL_CHARS).strip()
    if not name:
        raise GhostedError(f"choose a model: an embedded one ({', '.join(EMBEDDED)}) or a Hub id")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        raise GhostedError("a model name has no control characters; type an embedded model or a Hub id (org/name)")
    if name in EMBEDDED:
        return name, False
    setting = local_folders()
    if setting is True:
        return name, True
    if setting is False:
        if _looks_local(name):
            raise GhostedError(f"local model folders are off on this server, so {name!r} cannot be opened; use an "
                               f"embedded model ({', '.join(EMBEDDED)}) or a Hub id (org/name)")
        return name, False
    target = Path(name).expanduser().resolve()
    if target == setting or setting in target.parents:
        return name, True
    if _looks_local(name):
        raise GhostedError(f"{name!r} is outside the folder this server opens to its users ({setting}); use a "
                           f"model folder inside it, an embedded model ({', '.join(EMBEDDED)}) or a Hub id")
    return name, False


def text(value: object, label: str, limit: int) -> str:
    """A string of at most `limit` characters ('' for None)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise GhostedError(f"'{label}' must be text (got {type(value).__name__})")
    if len(value) > limit:
        raise GhostedError(f"'{label}' is {len(value):,} characters long; at most {limit:,} are accepted")
    return value


def whole(value: object, label: str, low: int, high: int) -> int:
    """A whole number in [low, high], as the page's slider or number box would give it. Compared as it came (an
    int of thousands of digits has no float), and named briefly in the refusal."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
            or isinstance(value, float) and not value.is_integer():  # NaN fails the range, ±inf too
        raise GhostedError(f"'{label}' must be a whole number from {low} to {high} (got {number_text(value)})")
    return int(value)


def number_text(value: object) -> str:
    """A value as a refusal names it: a number in %g form (a long int by its digit count), anything else briefly."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:  # (str() stops at 4,300 digits)
        return f"a whole number of about {int(value.bit_length() * math.log10(2)) + 1:,} digits"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    return f"{value!r:.40}"


def flag(value: object, label: str) -> bool:
    """A checkbox's value: True or False, never a truthy string."""
    if not isinstance(value, bool):
        raise GhostedError(f"'{label}' must be true or false (got {value!r:.40})")
    return value


def choice(value: object, label: str, choices: Sequence) -> object:
    """One of `choices`."""
    if value not in choices:
        raise GhostedError(f"'{label}' must be one of {', '.join(map(str, choices))} (got {value!r})")
    return value


def names(values: object, label: str) -> tuple[str, ...]:
    """A list of short strings (operators, corpora, tasks); the library checks each name."""
    if values is None:
        return ()
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise GhostedError(f"'{label}' must be a list of names")
    if len(values) > 64 or any(len(v) > FIELD_CHARS for v in values):
        raise GhostedError(f"'{label}' holds too many or too long names")
    return tuple(values)
