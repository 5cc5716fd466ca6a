"""Whose Hub access a visitor's request uses: the visitor's own (the Space's sign-in), or none.

The server's own token (HF_TOKEN, which an operator sets for the gated presets they accepted)
is never lent to a visitor by default: with it, anyone could name the operator's private repos
or a gated model whose terms they never accepted, and download or push its weights. The operator
lends it for the models they list in GHOSTED_APP_SERVER_TOKEN_MODELS (Hub ids or preset keys, a
comma list; `*` lends it for every model, which `make app` sets on one's own machine, where the
visitor is the operator), as gguf-my-repo downloads with the signed-in visitor's token. The token travels in
`LoadOptions.hub_token`; the model cache keeps what a visitor's token loaded apart from what
anyone may load (`studio.cache.cache_key`).
"""

from __future__ import annotations

import os

import gradio as gr

from studio.presets_view import find_preset

SERVER_TOKEN_ENV = "GHOSTED_APP_SERVER_TOKEN_MODELS"


def server_token_models() -> set[str]:
    """The Hub ids the operator lends the server's token for (preset keys resolved to their ids)."""
    names = {n.strip() for n in os.environ.get(SERVER_TOKEN_ENV, "").split(",") if n.strip()}
    return {(find_preset(n).hub_id if find_preset(n) else n) for n in names}


def hub_token(model: str, oauth_token: gr.OAuthToken | None) -> str | bool | None:
    """The Hub access for `model` in this request: None (huggingface_hub's own, i.e. the server's token) for a
    model the operator lists; else the signed-in visitor's token; else False (anonymous)."""
    preset = find_preset(model)
    lent = server_token_models()
    if "*" in lent or (preset.hub_id if preset else model) in lent:
        return None
    token = getattr(oauth_token, "token", None) if oauth_token is not None else None
    return token if isinstance(token, str) and token.strip() else False
