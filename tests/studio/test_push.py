"""The Hub push the Space way: the token's source, refusals, and the served app pushing a run's saved model.

No network here: `huggingface_hub.HfApi` is replaced by a recording fake, and the Hub check is told the
Hub is up. gradio_client passes an OAuth token as a signed-in Space user's session would
(`Client(..., oauth_token=...)`, injected into the handler's `gr.OAuthToken | None` parameter).
What cannot be tested here: the real OAuth redirect and consent screen, the scopes the Space grants,
the token's actual permissions, and the Hub's own answer (URL, private flag, an existing repo).
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import gradio as gr
import pytest

from ghosted_core.errors import GhostedError
from studio import layout, outputs, push
from studio.saved import SavedModels

README = Path(__file__).parents[2] / "README.md"


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records each call with the token it was made with."""

    calls: list = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, **kwargs):
        from huggingface_hub import RepoUrl

        type(self).calls.append(("create_repo", repo_id, kwargs, self.token))
        owned = repo_id if "/" in repo_id else f"oauth-user/{repo_id}"  # the Hub puts a bare name in the token's namespace
        return RepoUrl(f"https://huggingface.co/{owned}")

    def upload_folder(self, **kwargs):
        files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        type(self).calls.append(("upload_folder", kwargs, files, self.token))


@pytest.fixture
def online(monkeypatch):
    """The Hub 'reachable' and HfApi recording, for the push path only."""
    import huggingface_hub

    import ghosted_core.export.folder as export_folder

    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(export_folder, "hub_reachable", lambda: True)
    monkeypatch.setattr(push, "hub_reachable", lambda: True)
    return RecordingApi


def test_the_space_front_matter_asks_for_oauth_with_repo_creation():
    front = README.read_text().split("---")[1]
    assert re.search(r"^hf_oauth: true$", front, re.MULTILINE)
    scopes = re.search(r"^hf_oauth_scopes:\n((?:\s+- .+\n)+)", front, re.MULTILINE).group(1)
    assert [s.strip("- ").strip() for s in scopes.splitlines()] == list(push.OAUTH_SCOPES)
    assert "manage-repos" in push.OAUTH_SCOPES  # creating a repo needs it (Hub OAuth docs)


def test_offline_the_push_is_off_and_says_why():
    on, note = push.push_available()  # HF_HUB_OFFLINE=1 in the tests
    assert not on and "off" in note and "cannot be reached" in note


def test_the_token_comes_from_the_sign_in_on_a_space_and_from_the_paste_elsewhere(monkeypatch):
    signed_in = gr.OAuthToken(token="hf_oauth", scope="write-repos", expires_at=0)
    assert push.push_token("hf_pasted", signed_in) == "hf_oauth"
    assert push.push_token(" hf_pasted ", None) == "hf_pasted"
    with pytest.raises(GhostedError, match="paste a Hugging Face write token"):
        push.push_token("", None)
    monkeypatch.setattr(push, "on_space", lambda: True)
    with pytest.raises(GhostedError, match="sign in with Hugging Face first"):
        push.push_token("", None)


def test_a_bare_repo_name_goes_to_the_signed_in_users_namespace():
    profile = gr.OAuthProfile({"preferred_username": "ada", "name": "Ada", "picture": "", "profile": ""})
    assert push.repo_name(" pruned ", profile) == "ada/pruned"
    assert push.repo_name("org/pruned", profile) == "org/pruned" and push.repo_name("pruned", None) == "pruned"
    with pytest.raises(GhostedError, match="name the new repo"):
        push.repo_name(" ", profile)


def test_nothing_saved_is_refused_and_the_token_is_never_echoed(monkeypatch, tmp_path):
    monkeypatch.setattr(push, "SAVED", SavedModels(root=tmp_path))  # this session has saved nothing
    message, token = push.on_push("me/model", False, "hf_secret123", None, None, None)
    assert "save a model first" in message and token == "" and "hf_secret123" not in message


def test_saved_models_keep_one_folder_per_session_and_forget_the_oldest(tmp_path):
    saved = SavedModels(capacity=2, root=tmp_path)
    first = saved.new_folder("a")
    (first / "m").mkdir()
    (first / "m" / "config.json").write_text("{}")
    assert saved.latest("a") == first / "m" and saved.latest("b") is None
    again = saved.new_folder("a")
    assert not first.exists() and saved.latest("a") is None  # a new save replaces the session's previous one
    saved.new_folder("b")
    saved.new_folder("c")
    assert not again.exists()  # beyond the capacity, the least recently used session's folder goes


def test_on_a_space_the_page_has_the_login_button_and_no_token_box(monkeypatch):
    """Built as on a Space. Gradio attaches its OAuth routes when the page has a LoginButton, which needs the
    `gradio[oauth]` extra (in requirements.txt for the Space) and the Space's OAuth variables: not here."""
    import gradio.routes

    monkeypatch.setattr(gradio.routes, "attach_oauth", lambda app: None)
    monkeypatch.setattr(push, "on_space", lambda: True)
    monkeypatch.setattr(layout, "on_space", lambda: True)
    monkeypatch.setattr(layout, "push_available", lambda: (True, "sign in"))
    config = layout.build_demo().config
    by_id = {c.get("props", {}).get("elem_id"): c for c in config["components"]}
    assert "Sign in with Hugging Face" in by_id["login-button"]["props"]["value"]  # gr.LoginButton
    token_box = next(c for c in config["components"] if c.get("props", {}).get("elem_id") == "push-token")
    assert token_box["props"]["visible"] is False


def test_locally_there_is_no_login_button():
    config = layout.build_demo().config
    ids = {c.get("props", {}).get("elem_id") for c in config["components"]}
    assert "login-button" not in ids and "push-token" in ids  # a LoginButton would call the Hub at startup


# ---------------------------------------------------------------- the served app, through gradio_client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served(online, tiny_model_folder):
    """A fresh page served on a free port (built while the Hub is 'up'), and a factory of clients."""
    from gradio_client import Client

    demo = layout.build_demo()
    port = free_port()
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)

    def client(**kwargs):
        return Client(f"http://127.0.0.1:{port}/", verbose=False, httpx_kwargs={"timeout": 300}, **kwargs)
    try:
        yield client
    finally:
        demo.close()


def tiny_run(client, tiny_model_folder, **changes) -> dict:
    """A run of the tiny model folder that saves magcomp_refit as a stock folder; the run's outputs."""
    kwargs = dict(model=str(tiny_model_folder), criterion="manual", manual_blocks="2,3",
                  operators=["none", "magcomp_refit"], samples=4, seqlen=64, eval_corpora=["ptb"], eval_tokens=256,
                  prompt="", save_variant="magcomp_refit", export_format="stock") | changes
    return dict(zip(outputs.OUTPUT_NAMES, client.predict(api_name="/run", **kwargs)))


def test_a_signed_in_user_pushes_the_runs_saved_model_with_their_oauth_token(served, online, tiny_model_folder):
    client = served(oauth_token="hf_oauth_user_token")
    view = client.view_api(print_info=False, return_format="dict")
    assert view["named_endpoints"]["/push"].get("oauth_token") == "optional"
    result = tiny_run(client, tiny_model_folder)
    assert "Run complete" in result["status"] and "**stock**" in result["save_note"]
    message, token_box = client.predict("pruned-tiny", True, "", api_name="/push")
    (create, repo, kwargs, used), (upload, upload_kwargs, files, upload_token) = online.calls
    assert (create, repo, used, kwargs["private"], kwargs["exist_ok"]) == \
        ("create_repo", "pruned-tiny", "hf_oauth_user_token", True, False)
    assert upload == "upload_folder" and upload_token == "hf_oauth_user_token"
    assert {"README.md", "config.json", "model.safetensors", "ghosted.json"} <= set(files)  # the folder, not a zip
    assert json.loads((Path(upload_kwargs["folder_path"]) / "config.json").read_text())["num_hidden_layers"] == 4
    assert "https://huggingface.co/oauth-user/pruned-tiny" in message and "private" in message and token_box == ""
    assert "hf_oauth_user_token" not in message


def test_a_signed_out_user_is_refused_with_a_message(served, online, tiny_model_folder, monkeypatch):
    client = served()  # no OAuth token: signed out
    tiny_run(client, tiny_model_folder)
    message, _ = client.predict("pruned-tiny", False, "", api_name="/push")
    assert "Push refused" in message and "paste a Hugging Face write token" in message
    monkeypatch.setattr(push, "on_space", lambda: True)
    message, _ = client.predict("pruned-tiny", False, "", api_name="/push")
    assert "Push refused" in message and "sign in with Hugging Face first" in message
    assert online.calls == []  # the Hub was never called
    monkeypatch.setattr(push, "on_space", lambda: False)
    message, _ = client.predict("pruned-tiny", False, "hf_pasted_token", api_name="/push")  # a local run's paste
    assert "Pushed" in message and online.calls[0][3] == "hf_pasted_token"


def test_a_gguf_save_downloads_the_gguf_and_pushes_it_with_the_folder(served, online, tiny_model_folder):
    from ghosted_core.export.gguf import find_llamacpp

    try:
        find_llamacpp()
    except GhostedError as err:
        pytest.skip(str(err))
    client = served(oauth_token="hf_oauth_user_token")
    result = tiny_run(client, tiny_model_folder, export_format="gguf", gguf_type=["q8_0"])
    assert str(result["model_file"]).endswith("-magcomp_refit-q8_0.gguf") and "**GGUF**" in result["save_note"]
    message, _ = client.predict("pruned-tiny-gguf", False, "", api_name="/push")
    files = online.calls[1][2]
    assert any(f.endswith("-q8_0.gguf") for f in files) and "config.json" in files
    assert ".gguf" in message


def test_several_gguf_types_download_as_one_zip_and_all_are_pushed(served, online, tiny_model_folder):
    """Two types and the importance matrix: the download is a zip of both GGUF files, the note lists each with
    its size and perplexity, and the push sends both with the folder."""
    import zipfile

    from ghosted_core.export.gguf import find_llamacpp

    try:
        find_llamacpp()
    except GhostedError as err:
        pytest.skip(str(err))
    client = served(oauth_token="hf_oauth_user_token")
    result = tiny_run(client, tiny_model_folder, export_format="gguf", gguf_type=["q4_k_m", "q8_0"],
                      gguf_imatrix=True)
    archive = Path(result["model_file"])
    assert archive.name.endswith("-magcomp_refit-gguf.zip"), archive
    with zipfile.ZipFile(archive) as zipped:
        inside = sorted(Path(n).name for n in zipped.namelist())
    assert [n.rsplit("-", 1)[1] for n in inside] == ["q4_k_m.gguf", "q8_0.gguf"]
    note = result["save_note"]
    assert all(f"`{name}` (" in note and "MB, ppl " in note for name in inside) and "importance matrix" in note
    message, _ = client.predict("pruned-tiny-ggufs", False, "", api_name="/push")
    files = online.calls[1][2]
    assert set(inside) <= set(files) and not any(f.endswith("f16.gguf") for f in files)
    assert all(f"`{name}`" in message for name in inside)


def test_an_unknown_gguf_type_is_refused_before_the_run(served, tiny_model_folder, capsys):
    """Gradio refuses a type that is not among the choices before the handler runs; the library refuses it too."""
    from ghosted_core.run.options import RunOptions, parse_variants
    from studio.runner import QuickTasks, build_request

    client = served()
    with pytest.raises(Exception, match="400 Bad Request"):
        tiny_run(client, tiny_model_folder, export_format="gguf", gguf_type=["q2_k"])
    assert "'q2_k' (type: <class 'str'>) is not in the list of choices" in capsys.readouterr().out
    with pytest.raises(GhostedError, match="unknown GGUF type 'q2_k'"):
        build_request(RunOptions(model=str(tiny_model_folder), variants=parse_variants("none,magcomp_refit"),
                                 num_prune=2),
                      QuickTasks(), "magcomp_refit", "gguf", "single depth", "", gguf_type=["q2_k"])


def test_every_push_error_is_one_message_and_clears_the_token_box(served, online, tiny_model_folder, monkeypatch):
    import httpx
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    client = served()
    tiny_run(client, tiny_model_folder)
    token = "hf_secret_pasted_token"
    failures = {"offline": OfflineModeIsEnabled(f"Cannot reach https://huggingface.co: offline mode (token {token})"),
                "connection": httpx.ConnectError("[Errno 111] Connection refused"),
                "dropped": ConnectionResetError(104, "Connection reset by peer"),
                "hub": HfHubHTTPError(f"401 Unauthorized: invalid token {token}", response=httpx.Response(
                    401, request=httpx.Request("POST", "https://huggingface.co/api/repos/create")))}
    for name, failure in failures.items():
        def fail(self, repo_id, **kwargs):
            raise failure
        monkeypatch.setattr(online, "create_repo", fail)
        message, token_box = client.predict("pruned-tiny", False, token, api_name="/push")
        assert message.startswith("**Push refused:** upload to pruned-tiny failed (") and token_box == "", (name, message)
        assert token not in message and "Traceback" not in message and len(message.splitlines()) == 1, (name, message)
        assert type(failure).__name__ in message, (name, message)


def test_on_a_space_only_the_account_that_saved_a_model_pushes_it(served, online, tiny_model_folder, monkeypatch):
    import httpx

    accounts = {"tok-alice": "alice", "tok-mallory": "mallory"}
    monkeypatch.setattr(online, "whoami", lambda self: {"name": accounts[self.token]}, raising=False)
    monkeypatch.setattr(push, "on_space", lambda: True)
    alice = served(oauth_token="tok-alice")
    assert "Run complete" in tiny_run(alice, tiny_model_folder)["status"]
    # a stranger who learnt alice's session id, signed in as themselves, asks to push alice's saved model
    body = {"data": ["stolen", False, ""], "session_hash": alice.session_hash, "oauth_token": "tok-mallory"}
    posted = httpx.post(f"{alice.src.rstrip('/')}/gradio_api/call/push", json=body, timeout=60)
    with httpx.stream("GET", f"{alice.src.rstrip('/')}/gradio_api/call/push/{posted.json()['event_id']}",
                      timeout=60) as stream:
        data = [line for line in stream.iter_lines() if line.startswith("data: ")]
    message, token_box = json.loads(data[-1].removeprefix("data: "))
    assert "Push refused" in message and "saved by another Hugging Face account" in message and token_box == ""
    assert online.calls == []  # nothing reached the Hub
    message, _ = alice.predict("mine", False, "", api_name="/push")  # alice herself
    assert "Pushed" in message and online.calls[0][1] == "mine" and online.calls[0][3] == "tok-alice"
