"""What a stock export of a cut Gemma 4 E2B-shaped model holds beyond the model: its kept per-layer table written a
vocabulary slab at a time (ours) against the table's kept slices copied whole and then written (the straightforward
export), side by side, each in a fresh process.

The model is random and E2B-shaped where the table is concerned (E2B's vocabulary of 262,144 and per-layer width
256, 8 blocks: a 2 GiB fp32 table) and small elsewhere (C = 256); one block is removed, so 7/8 of the table is
written. Prints, per method, the export's wall time and its peak RSS above the process's RSS before the export
(the model is loaded and cut first), and that both folders hold the same tensors.

    .venv/bin/python bench/export_streaming.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("streamed", "copied")


def rss_gib() -> float:
    """The process's resident set now (GiB), from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def one(method: str, folder: Path) -> dict:
    """Build, cut and export in this process; the export's time and peak RSS above the RSS before it."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    sys.path[:0] = [str(ROOT)]
    from ghosted_core.export.folder import export_variant
    from ghosted_core.model import side_inputs
    from ghosted_core.model.surgery import build_variant

    if method == "copied":  # the straightforward export: the kept slices gathered into one new tensor
        def copied(self, device: str = "cpu") -> dict:
            weight = self.packed.weight
            index = torch.tensor([j * self.width + k for j in self.rows for k in range(self.width)])
            return {"weight": weight.detach().index_select(self._packed_axis(), index).to(device)}
        side_inputs.PackedRows.export_tensors = copied
    torch.manual_seed(0)
    config = Gemma4TextConfig(vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=256,
                              intermediate_size=512, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=128, global_head_dim=128, hidden_size_per_layer_input=256,
                              num_kv_shared_layers=0, sliding_window=64,
                              layer_types=["sliding_attention"] * 7 + ["full_attention"])
    dense = Gemma4ForCausalLM(config).eval()
    cut = build_variant(dense, (3,), record={"dense_layers": 8, "removed_layers": [3], "operator": "none",
                                             "boundaries": [[3, 4]]})
    before = rss_gib()
    started = time.perf_counter()
    export_variant(cut, None, folder, mode="stock")
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    table = dense.model.embed_tokens_per_layer.weight
    return {"method": method, "seconds": round(seconds, 2), "peak_above_gib": round(peak - before, 3),
            "table_gib": round(table.numel() * table.element_size() / 2**30, 3)}


def same_tensors(a: Path, b: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            found |= load_file(file)
        return found
    left, right = tensors(a), tensors(b)
    return set(left) == set(right) and all(torch.equal(left[k], right[k]) for k in left)


def main() -> None:
    if len(sys.argv) == 3:  # a worker: one method, printed as JSON
        print(json.dumps(one(sys.argv[1], Path(sys.argv[2]))))
        return
    with tempfile.TemporaryDirectory() as work:
        results = {}
        for method in METHODS:
            done = subprocess.run([sys.executable, __file__, method, str(Path(work) / method)], check=True,
                                  capture_output=True, text=True)
            results[method] = json.loads(done.stdout.strip().splitlines()[-1])
        same = same_tensors(Path(work) / "streamed", Path(work) / "copied")
    ours, base = results["streamed"], results["copied"]
    print(f"per-layer table {ours['table_gib']:.2f} GiB (fp32), one of 8 blocks removed")
    for r in (ours, base):
        print(f"  {r['method']:9s} export {r['seconds']:6.2f} s, peak RSS above the cut model "
              f"{r['peak_above_gib']:.2f} GiB")
    print(f"streamed / copied: peak {ours['peak_above_gib'] / max(base['peak_above_gib'], 1e-9):.2f}×, time "
          f"{ours['seconds'] / base['seconds']:.2f}×; same tensors written: {same}")


if __name__ == "__main__":
    main()
