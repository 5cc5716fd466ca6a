"""The command line's bad-input table: every row is refused with one line on stderr and exit code 2, before any work.

Each row runs `python -m ghosted_core`'s `main` in its own process with its own stderr and exit
code; the processes are forked from one interpreter that imported the CLI once (torch and
transformers take seconds to import), so the table of 40 rows costs about one import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from transformers import GPT2Config, Starcoder2Config

from conftest import _tiny_config
from ghosted_core.plan import MAX_BLOCKS

# Reads the rows (argv lists) on stdin; forks one child per row whose stdout and stderr go to files,
# and prints one JSON line per row: exit code, seconds, stderr.
FORK_SERVER = textwrap.dedent("""
    import json, os, sys, tempfile, time, traceback
    from ghosted_core.cli import main

    def child(argv, out, err):
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1)
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        try:
            code = main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)

    with tempfile.TemporaryDirectory() as folder:
        for k, argv in enumerate(json.loads(sys.stdin.read())):
            out, err = f"{folder}/{k}.out", f"{folder}/{k}.err"
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                child(argv, out, err)
            _, status = os.waitpid(pid, 0)
            print(json.dumps({"code": os.waitstatus_to_exitcode(status), "seconds": time.perf_counter() - start,
                              "stderr": open(err).read()}), flush=True)
""")


def table(tmp) -> list[tuple[list[str], str]]:
    """(arguments, what the one stderr line must say); `tmp` holds the files some rows point at."""
    (tmp / "a-file").write_text("not a folder")
    (tmp / "full").mkdir()
    (tmp / "full" / "ghost").mkdir()
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "binary.txt").write_bytes(b"\x00\x01\x02binary" * 10)
    manual = ["--pruning_method", "manual", "--layers"]
    configs = {"hybrid": _tiny_config("granitemoehybrid")[1], "moe": _tiny_config("qwen3_moe")[1],
               "gpt2": GPT2Config(n_layer=2, n_embd=16, n_head=2), "generic": Starcoder2Config(
                   num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=97)}
    for name, config in configs.items():  # a config alone: the family is refused before weights are read
        config.save_pretrained(tmp / name)
    family = {name: ["--model", str(tmp / name), "--seqlen", "64", "--total_num_prune", "2"] for name in configs}
    return [
        ([*family["hybrid"], "--insert_type", "none,replaceme"], "no single module of a Granite-4 hybrid block computes"),
        ([*family["hybrid"], "--insert_type", "none+kd_mlp"], "no single module of a Granite-4 hybrid block is the MLP"),
        ([*family["moe"], "--insert_type", "refit"], "Qwen3-MoE's MLP is experts"),
        ([*family["generic"], "--insert_type", "magcomp"], "'starcoder2' has no entry in the architecture table"),
        ([*family["generic"], "--pruning_method", "weights"], "the weights criterion acts on the modules"),
        (family["gpt2"], "unsupported architecture 'gpt2': no decoder blocks at model.layers"),
        (["--total_num_prune", "30"], "leaves none"),
        ([*manual, ""], "needs the blocks to remove"),  # refused before the model and the corpus load
        (["--total_num_prune", "0"], "must be at least 1"),
        (["--total_num_prune", "seven"], "write a number of blocks"),
        (["--total_num_prune", "2:10:0"], "step must be at least 1"),
        (["--total_num_prune", "10:2:2"], "starts above its stop"),
        (["--total_num_prune", "2:40:2"], "leaves none"),
        (["--total_num_prune", "2:x:2"], "cannot read"),
        (["--total_num_prune", f"1:{10**11}:1"], "beyond any model's blocks"),
        (["--model", "no-such-model"], "unknown model"),
        (["--model", "meta-llama/Llama-3.1-8B"], "Hub is not reachable"),
        (["--model", "some-org/../../etc"], "without a path"),
        (["--model", "some-org/model/../x"], "without a path"),
        (["--model", "../../etc/passwd"], "unknown model"),
        (["--model", "file:///etc/passwd"], "unknown model"),
        (["--insert_type", "ghost,magic"], "unknown operator 'magic'"),
        (["--insert_type", ""], "no recovery operator given"),
        (["--pruning_method", "random"], "invalid choice"),
        (["--calibration_data", "nowhere"], "unknown corpus"),
        ([*manual, "3,99"], "out of range"),
        ([*manual, "5-3"], "reversed block range '5-3'"),
        ([*manual, "3,,x"], "cannot read block list"),
        ([*manual, f"0-{10**11}"], f"at most {MAX_BLOCKS - 1}"),
        (["--seqlen", "9000"], "exceed the model's 8192 positions"),  # SmolLM2: max_position_embeddings 8192
        (["--eval_seqlen", "8193"], "exceed the model's 8192 positions"),
        (["--eval_seqlen", "1"], "--eval_seqlen must be at least 2"),
        (["--batch_size", "0"], "--batch_size must be at least 1"),
        (["--task_batch_size", "-1", "--eval_tasks", "copa"], "--task_batch_size must be at least 1"),
        (["--eval_tasks", "arc_easy,hellaswagg"], "unknown task(s): hellaswagg"),
        (["--device", "map", "--max_memory", "cpu:3GB"], "cannot read --max_memory"),
        (["--device", "map", "--max_memory", "0=1e999GiB"], "cannot read --max_memory"),
        (["--device", "map", "--max_memory", "cpu=0"], "cannot read --max_memory"),
        (["--max_memory", "cpu=3GB"], "apply to --device map only"),
        (["--eval_max_tokens", "-5"], "--eval_max_tokens must be at least 1"),
        (["--heldout_size", "-1"], "--heldout_size must be at least 0"),
        (["--seed", "-1"], "--seed must be between 0 and"),
        (["--max_new_tokens", "0", "--prompt", "Hello"], "--max_new_tokens must be at least 1"),
        (["--sink_capacity", "-1"], "--sink_capacity must be at least 0"),
        (["--sink_ratio", "nan"], "--sink_ratio must be a finite number above 1"),
        (["--epsilon", "nan"], "--epsilon must be a finite number"),
        (["--ridge_lambda", "-1"], "--ridge_lambda must be a finite number above 0"),
        (["--outdir", str(tmp / "a-file" / "out")], "cannot be created or written"),
        (["--save_model", str(tmp / "full")], "is not empty (it holds ghost)"),
        (["--save_model", str(tmp / "a-file")], "is a file"),
        (["--total_num_prune", "2:4:2", "--save_model", str(tmp / "new")], "--save_model saves the variants of one depth"),
        (["--export", "stock", "--insert_type", "ghost", "--save_model", str(tmp / "new")], "cannot fold into a stock"),
        (["--export", "gguf", "--gguf_type", "q4_k_m,q3_k_s", "--save_model", str(tmp / "new")],
         "argument --gguf_type: unknown GGUF type 'q3_k_s'; use one or more of f16, q8_0, q6_k, q5_k_m, q4_k_m"),
        (["--export", "gguf", "--gguf_type", ",", "--save_model", str(tmp / "new")], "no GGUF type given"),
        (["--gguf_imatrix", "--save_model", str(tmp / "new")], "--gguf_imatrix quantizes GGUF files: add"),
        (["--gguf_imatrix_chunks", "8"], "--gguf_imatrix_chunks sets the importance matrix's windows: add"),
        (["--export", "gguf", "--gguf_type", "q4_k_m", "--gguf_imatrix", "--gguf_imatrix_chunks", "0", "--save_model",
          str(tmp / "new")], "--gguf_imatrix_chunks must be at least 1 (got 0)"),
        (["--calibration_data", "yours", "--user_text", str(tmp / "empty.txt")], "is empty"),
        (["--calibration_data", "yours", "--user_text", str(tmp / "binary.txt")], "not UTF-8 text"),
        (["--calibration_data", "yours", "--user_text", str(tmp / "missing.txt")], "no such file"),
        (["--user_text", str(tmp / "binary.txt")], "--user_text is given but not used"),
    ]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Every row of the table run through the CLI: (arguments, message, {code, seconds, stderr})."""
    tmp = tmp_path_factory.mktemp("bad-input")
    rows = table(tmp)
    argvs = [[*args, "--eval_ppl", "none", "--outdir", str(tmp / "out")] if "--outdir" not in args
             else [*args, "--eval_ppl", "none"] for args, _ in rows]
    done = subprocess.run([sys.executable, "-c", FORK_SERVER], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(rows)
    return [(args, message, answer) for (args, message), answer in zip(rows, answers)]


def test_the_table_has_at_least_twenty_rows_and_every_one_is_refused_in_one_line_with_exit_code_2(refused):
    assert len(refused) >= 20
    wrong = []
    for args, message, answer in refused:
        lines = [line for line in answer["stderr"].splitlines() if line.strip()]  # not --quiet: logs would show
        ok = (answer["code"] == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
              and "Traceback" not in answer["stderr"])
        if not ok:
            wrong.append(f"{args}: exit {answer['code']}, stderr {answer['stderr'][-400:]!r}")
    assert not wrong, "\n".join(wrong)


def test_every_refusal_comes_before_any_work(refused):
    """Refused while checking the flags, files and folders: seconds, not the minutes a run takes."""
    slow = [(args, round(answer["seconds"], 1)) for args, _, answer in refused if answer["seconds"] > 20]
    assert not slow, slow
