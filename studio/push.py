"""Push the session's saved model to the Hugging Face Hub, the way Space users expect (as gguf-my-repo does).

On a Space (front matter `hf_oauth: true`) the page shows "Sign in with Hugging Face" and the push
handler receives the user's OAuth token (`gr.OAuthToken | None`, injected by gradio, None when
signed out), so the model lands in the user's own namespace. Elsewhere the login button is not
rendered: outside a Space gradio would mock the OAuth routes and call the Hub at startup (which
fails offline) and needs the `gradio[oauth]` extra; a pasted write token is used instead. The
push uploads the folder the run saved (`studio.saved`): the chosen variant, its model card and its
GGUF when one was asked for, into a new repo (never an existing one), public or private, and gives
the URL back. Tokens are handed to huggingface_hub only: never logged, stored or echoed.
"""

from __future__ import annotations

import logging

import gradio as gr
from gradio.utils import get_space

from ghosted_core.errors import GhostedError
from ghosted_core.export.folder import upload_export
from ghosted_core.hub import hub_reachable
from studio import guard
from studio.outputs import page_message
from studio.saved import SAVED

log = logging.getLogger(__name__)

# what the Space's sign-in asks for: read and write the user's repos, and create new ones (manage-repos)
OAUTH_SCOPES = ("read-repos", "write-repos", "manage-repos")


def on_space() -> bool:
    """Whether the app is served by a Hugging Face Space (where the OAuth sign-in exists)."""
    return get_space() is not None


def push_available() -> tuple[bool, str]:
    """Whether the push controls are on here, and the note beside them (why not, when off)."""
    if not hub_reachable():
        return False, ("Pushing to the Hugging Face Hub is **off**: the Hub cannot be reached from this machine. "
                       "Download the model above instead.")
    if on_space():
        return True, ("**Sign in with Hugging Face** to push the saved model, its model card and its GGUF (if "
                      "asked for) into a new repo of your own namespace.")
    return True, ("Paste a Hugging Face **write** token to push the saved model, its model card and its GGUF (if "
                  "asked for) into a new repo. The token is used for this push only: never logged, stored or shown "
                  "again. (On a Space you would sign in with Hugging Face instead.)")


def push_token(pasted: str | None, oauth_token: gr.OAuthToken | None) -> str:
    """The token to push with: the signed-in user's on a Space, the pasted one elsewhere; refused when neither."""
    if oauth_token is not None and getattr(oauth_token, "token", None):
        return oauth_token.token
    if pasted and pasted.strip():
        return pasted.strip()
    if on_space():
        raise GhostedError("sign in with Hugging Face first (the button above the repo name), then push again")
    raise GhostedError("paste a Hugging Face write token to push (huggingface.co/settings/tokens)")


def hub_account(oauth_token: gr.OAuthToken | None, profile: gr.OAuthProfile | None = None) -> str | None:
    """The Hub account of a signed-in visitor: the sign-in's profile, else whose the OAuth token is (the Hub
    says); None when signed out or the Hub cannot tell."""
    name = getattr(profile, "username", None) if profile is not None else None
    if name:
        return name
    token = getattr(oauth_token, "token", None) if oauth_token is not None else None
    if not token or not hub_reachable():
        return None
    from huggingface_hub import HfApi

    try:
        return HfApi(token=token).whoami().get("name")
    except Exception:  # an expired or bad token, the Hub down: nobody we can name
        log.info("the Hub could not say whose the sign-in token is")
        return None


def saving_account(oauth_token: gr.OAuthToken | None, profile: gr.OAuthProfile | None = None) -> str | None:
    """Who saves a model now, as the push will check it: the signed-in account on a Space, None elsewhere."""
    return hub_account(oauth_token, profile) if on_space() else None


def check_owner(saver: str | None, pusher: str | None) -> None:
    """On a Space, only the account that ran and saved a model may push it (a session id alone proves nothing)."""
    if not on_space():
        return
    if saver is None:
        raise GhostedError("on this Space a model is pushed by the account that saved it: sign in with Hugging "
                           "Face, then run and save again")
    if pusher != saver:
        raise GhostedError("this model was saved by another Hugging Face account; sign in as that account, or run "
                           "and save your own")


def repo_name(repo_id: str, profile: gr.OAuthProfile | None) -> str:
    """The new repo's id: `org/name` as given; a bare name goes to the signed-in user's namespace (or, with a
    pasted token, to the token owner's, which the Hub picks)."""
    name = (repo_id or "").strip()
    if not name:
        raise GhostedError("name the new repo (name, or org/name)")
    username = getattr(profile, "username", None) if profile is not None else None
    return f"{username}/{name}" if username and "/" not in name else name


def on_push(repo_id: str, private: bool, token: str, oauth_token: gr.OAuthToken | None = None,
            profile: gr.OAuthProfile | None = None, request: gr.Request | None = None) -> tuple[str, str]:
    """Push button: the session's saved model to a new Hub repo; (message with the URL, the token box cleared)."""
    try:
        repo_id, token = guard.text(repo_id, "New Hub repo", guard.FIELD_CHARS), guard.text(token, "token", guard.FIELD_CHARS)
        private = guard.flag(private, "Private repo")
        session = request.session_hash if request else ""
        folder = SAVED.latest(session)
        if folder is None:
            raise GhostedError("save a model first: choose a variant under 'Save a recovered model' and run")
        token = push_token(token, oauth_token)
        check_owner(SAVED.owner(session), saving_account(oauth_token, profile))
        url = upload_export(folder, repo_name(repo_id, profile), token, private=bool(private))
    except GhostedError as err:
        return f"**Push refused:** {page_message(err)}", ""
    except Exception:  # a bug of ours: logged without the token (no local holds it in the message), the box cleared
        log.exception("push failed")
        return "**Push failed** with an internal error (logged on the server); nothing else changed.", ""
    files = sorted(p.name for p in folder.iterdir())
    ggufs = ", ".join(f"`{f}`" for f in files if f.endswith(".gguf"))
    what = f"`{folder.name}`, its model card" + (f" and {ggufs}" if ggufs else "")
    return (f"Pushed {what} to a new {'private' if private else 'public'} repo: [{url}]({url}) "
            "(an existing repo is never overwritten)"), ""
