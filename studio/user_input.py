"""Your own text from the page: pasted, or an uploaded .txt / .jsonl, for calibration, evaluation or both.

The text becomes a `ghosted_core.user_text.UserText`, held in memory. An uploaded file is read
once per session and removed from Gradio's upload folder when the last session that used it ends
(`studio.uploads`): a refused run costs the visitor nothing, and nothing of the file outlives its session. The library never writes
it to its token cache.
"""

from __future__ import annotations

import logging

from ghosted_core.data import user_text
from ghosted_core.errors import GhostedError
from ghosted_core.data.user_text import USER_CORPUS, UserText
from studio.uploads import SESSION_UPLOADS

log = logging.getLogger(__name__)

USES = ("calibration", "evaluation", "both")  # what "your text" is used for


def read_user_text(pasted: str | None, upload: str | None, session: str = "") -> UserText | None:
    """The user's text for this run (an upload wins over pasted text), None when neither was given.

    GhostedError for an empty, binary, wrongly encoded or too large text, with what to do.
    """
    if upload:
        return SESSION_UPLOADS.read(session, upload)
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
