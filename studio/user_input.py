"""Your own text from the page: pasted, or an uploaded .txt / .jsonl, for calibration, evaluation or both.

The text becomes a `ghosted_core.user_text.UserText`, held in memory for one run. An uploaded
file is read once and then deleted from Gradio's upload folder, so nothing of it outlives the
run; the library never writes it to its token cache.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ghosted_core.data import user_text
from ghosted_core.errors import GhostedError
from ghosted_core.data.user_text import USER_CORPUS, UserText

log = logging.getLogger(__name__)

USES = ("calibration", "evaluation", "both")  # what "your text" is used for


def read_user_text(pasted: str | None, upload: str | None) -> UserText | None:
    """The user's text for this run (an upload wins over pasted text), None when neither was given.

    GhostedError for an empty, binary, wrongly encoded or too large text, with what to do.
    """
    if upload:
        path = Path(upload)
        if not path.is_file():
            raise GhostedError(f"{path.name}: the uploaded file is gone (uploads are deleted once a run has read "
                               "them); upload it again")
        try:
            return user_text.from_file(path)
        finally:
            path.unlink(missing_ok=True)  # the upload is used for this run only
    if pasted and pasted.strip():
        return user_text.from_text(pasted)
    if pasted:  # whitespace only
        raise GhostedError("the pasted text is empty; paste some text, or clear the box to use the built-in corpora")
    return None


def corpora_with_text(use: str, calibration: str, eval_corpora: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(calibration corpus, evaluation corpora) once "your text" takes the roles `use` names."""
    if use not in USES:
        raise GhostedError(f"use your text for one of: {', '.join(USES)}")
    if use in ("calibration", "both"):
        calibration = USER_CORPUS
    if use in ("evaluation", "both") and USER_CORPUS not in eval_corpora:
        eval_corpora = (*eval_corpora, USER_CORPUS)
    return calibration, eval_corpora
