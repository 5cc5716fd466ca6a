"""Hub presets in the model list: what each costs here, and why it cannot run when it cannot.

The numbers come from `ghosted_core.presets` (the models' published configs, written down) and
its estimates (memory plan and run time on the current device). Nothing downloads until a run
starts, and a run of a preset that cannot run here (offline, gated without a token, too big for
the device) is refused before it does.
"""

from __future__ import annotations

import functools

from ghosted_core.planning.estimate import DeviceInfo, current_device
from ghosted_core.model.embedded import EMBEDDED
from ghosted_core.run.options import RunOptions
from ghosted_core.planning.presets import PRESET_KINDS, PRESETS, Preset, preset_status

GIB = 2**30


@functools.lru_cache(maxsize=1)
def device() -> DeviceInfo:
    """This machine's device and its measured rates (measured once per process: ~0.2 s)."""
    return current_device()


def find_preset(name: str) -> Preset | None:
    """The preset named by its key or Hub id, else None."""
    name = (name or "").strip()
    return next((p for p in PRESETS.values() if name in (p.key, p.hub_id)), None)


def model_choices() -> list[tuple[str, str]]:
    """(label, value) pairs: the embedded models, then the Hub presets by kind and family (dense, mixture of experts,
    hybrid, multimodal; families alphabetically), by size within a family."""
    embedded = [(f"{name} (embedded; {spec.parts.size / 1e9:.1f} GB fetched from PyPI on first use)" if spec.on_demand
                 else f"{name} (embedded, offline)", name) for name, spec in EMBEDDED.items()]

    def order(p: Preset) -> tuple:
        return PRESET_KINDS.index(p.kind), p.family.lower(), p.params

    hub = [(f"{p.family} · {p.hub_id} ({p.params / 1e9:.2f}B, {p.kind}"
            f"{', gated' if p.gated else ''}; Hub)", p.hub_id) for p in sorted(PRESETS.values(), key=order)]
    return embedded + hub


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def preset_note(preset: Preset, options: RunOptions, depths: tuple[int, ...] | None = None) -> str:
    """Size, memory estimate and expected run time of `options` on the preset here, or why it cannot run."""
    status = preset_status(preset, options, device(), depths)
    memory, seconds = status.memory, status.seconds
    lines = [f"**{preset.hub_id}**: {preset.params / 1e9:.2f}B parameters ({preset.family}, {preset.num_layers} blocks, "
             f"width {preset.hidden_size}){', gated' if preset.gated else ''}; license {preset.license}.",
             f"Estimated here ({status.device.name}): about {memory.total / GIB:.1f} GiB at the peak (weights "
             f"{memory.weights_bytes / GIB:.1f} GiB, statistics {memory.stats_bytes / GIB:.2f} GiB) and about "
             f"{_duration(seconds.total)} for these settings (an estimate from the device's measured speed)."]
    if not status.available:
        lines.append(f"**Unavailable here:** {status.reason}.")
    return "  \n".join(lines)
