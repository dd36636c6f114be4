"""Draws docs/img/pipeline.png, the README's picture of the pipeline: `python docs/img/pipeline.py`."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

ROLE, STREAM, CONTROL = "#dbe9f6", "#fdebd0", "#e8f5e9"
BOXES = {  # name: (x, y, width, height, colour, text)
    "policy": (0.3, 4.2, 2.4, 1.1, ROLE, "policy service\ndispatches prompt groups\ninside the staleness window"),
    "prompts": (3.5, 4.35, 1.6, 0.8, STREAM, "prompts"),
    "workers": (5.9, 3.6, 3.0, 2.3, ROLE, "rollout workers\ncontinuous batching,\nlossless adaptive SD;\n"
                "idle: train the drafter"),
    "samples": (9.7, 4.9, 1.6, 0.8, STREAM, "samples"),
    "hidden": (9.7, 3.6, 1.6, 0.8, STREAM, "hidden"),
    "learner": (12.1, 4.5, 2.6, 1.6, ROLE, "learner\nGRPO on complete groups,\ncheckpoint, publish"),
    "control": (5.2, 0.6, 5.6, 1.2, CONTROL, "MQTT retained versions + Redis mirror\npolicy  |  drafter  |  sd_config"),
    "stats": (12.1, 2.0, 2.6, 0.8, STREAM, "stats -> monitor"),
}  # fmt: skip
ARROWS = [  # (start, end, label, curve): points on the boxes' edges
    ((2.75, 4.75), (3.45, 4.75), "", 0.0),  # policy -> prompts
    ((5.15, 4.75), (5.85, 4.75), "", 0.0),  # prompts -> workers
    ((8.95, 5.2), (9.65, 5.3), "", 0.0),  # workers -> samples
    ((8.95, 4.2), (9.65, 4.0), "", 0.0),  # workers -> hidden
    ((10.5, 3.55), (8.2, 3.55), "drafter training", -0.35),  # hidden -> workers (idle)
    ((11.35, 5.3), (12.05, 5.3), "", 0.0),  # samples -> learner
    ((12.4, 4.45), (10.85, 1.2), "policy version", 0.25),  # learner -> control
    ((6.9, 3.55), (6.9, 1.85), "drafter version", 0.0),  # workers -> control
    ((1.5, 4.15), (5.5, 1.85), "sd_config", 0.25),  # policy -> control
    ((8.3, 1.85), (8.3, 3.55), "versions", 0.0),  # control -> workers
    ((13.4, 4.45), (13.4, 2.85), "", 0.0),  # learner -> stats
]


def main() -> None:
    fig, ax = plt.subplots(figsize=(12, 5.2))
    for x, y, w, h, colour, text in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#555555"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)
    for a, b, label, curve in ARROWS:
        arrow = FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=12, color="#333333", lw=1.1,
                                connectionstyle=f"arc3,rad={curve}", shrinkA=0, shrinkB=0)  # fmt: skip
        ax.add_patch(arrow)
        if label:
            ax.text((a[0] + b[0]) / 2 + 0.1, (a[1] + b[1]) / 2, label, fontsize=8, color="#333333", ha="left")
    ax.text(0.3, 6.3, "Redis streams (orange): at-least-once delivery, exactly-once effect; blue: one process per role",
            fontsize=9, color="#444444")  # fmt: skip
    ax.set_xlim(0, 15)
    ax.set_ylim(0.2, 6.7)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    main()
