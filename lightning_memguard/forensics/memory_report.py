"""The memory report: why a step's memory is what it is, as a verdict, a JSON file and a self-contained HTML page.

A :class:`MemoryReport` holds a measured step's peak split into weights, gradients, optimizer state, saved
activations and the rest; the five modules whose saved activations are largest, by their names in the user's model;
the fixes that target them (:mod:`.fixes`); and the timeline of the forward pass by module. ``write`` puts
``<stem>.json`` and ``<stem>.html`` (and, on CUDA where PyTorch's allocator history was recorded,
``<stem>.pickle`` for PyTorch's memory viewer) beside each other, each written whole or not at all.

The JSON keys (``version`` 1):

- ``version``: 1; ``why``: ``"spill"``, ``"out_of_memory"``, ``"thrash"``, ``"adaptation"``, ``"plan"`` (``memguard
  plan --report``) or ``"sweep"`` (``memguard sweep --report``); ``step``: the global step (None for a plan);
  ``device``; ``samples``: samples in the measured batch, or in its largest micro-batch (None where unknown);
  ``scale``: the activations were measured on a ``1/scale`` part of the batch and multiplied (1: the whole);
  ``note``: how it was measured, in words;
- what happened on the card, where MemGuard knew it (None where not): ``capacity``: the memory judged against;
  ``other_processes``: what other processes held; ``judged_peak``: the peak the trigger was judged by, this
  process's and other processes' memory together (the figure a spill's message gives); ``batch``: samples in the
  batch that ran;
- ``peak``: bytes on the card at the step's peak, other processes' included; ``peak_measured``: true where the
  allocator measured this process's part (CUDA), false where it is the sum of the parts; ``split``: ``weights``,
  ``gradients``, ``optimizer``, ``activations``, ``rest``, ``others`` in bytes (``rest`` = this process's peak less
  its parts, never negative: the backward's buffers, the batch, the allocator's rounding; ``others``: other
  processes' memory, 0 where unknown);
- ``top``: up to five ``{"name", "class", "bytes", "share"}``: the modules (innermost) whose saved activations are
  largest, ``share`` of the peak; ``""`` is code outside every module (the loss);
- ``fixes``: sentences, the most targeted first;
- ``timeline``: the forward pass, one point per module's forward end: ``{"module", "saved", "allocated",
  "by_module"}``: bytes saved so far, the allocator's figure (None off CUDA), and the saved bytes so far of each top
  module and ``"other"``;
- ``snapshot``: the PyTorch snapshot's file name beside it, or None.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_memguard.core.files import written_atomically
from lightning_memguard.core.units import size_formatter
from lightning_memguard.forensics import fixes as rules
from lightning_memguard.forensics.attribution import OUTSIDE_LABEL, StepMemory

VERSION = 1
WHY = ("spill", "out_of_memory", "thrash", "adaptation", "plan", "sweep")
_HAPPENED = {
    "spill": "Spill", "out_of_memory": "Out of memory", "thrash": "Allocator thrash", "adaptation": "Adaptation",
    "plan": "Plan", "sweep": "Sweep",
}  # fmt: skip
TOP = 5
_COLOURS = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#bab0ac")


@dataclass(frozen=True)
class Situation:
    """What happened on the card, beside the measured step: what a report's page explains without the message.

    Attributes:
        capacity: the memory judged against (None: unknown).
        others: what other processes held (None: unknown).
        judged: the peak the trigger was judged by, this process's and other processes' memory together: a spill's
            ``used_bytes``, the figure its message gives.
        batch: samples in the batch that ran.
        grew_back: an adaptation to fewer micro-batches, in words: the step it reports on fits, and no fix is named.
    """

    capacity: int | None = None
    others: int | None = None
    judged: int | None = None
    batch: int | None = None
    grew_back: str | None = None


@dataclass
class MemoryReport:
    """A step's memory, explained (see the module's docstring for the JSON keys)."""

    why: str
    step: int | None
    device: str
    peak: int
    peak_measured: bool
    split: dict[str, int]
    top: list[dict[str, Any]]
    fixes: list[str]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    samples: int | None = None
    scale: float = 1
    note: str = ""
    snapshot: str | None = None
    capacity: int | None = None
    other_processes: int | None = None
    judged_peak: int | None = None
    batch: int | None = None

    @classmethod
    def from_step(
        cls,
        memory: StepMemory,
        why: str,
        step: int | None = None,
        advice: str | None = None,
        note: str = "",
        situation: Situation | None = None,
    ) -> MemoryReport:
        """The report of a measured step; ``advice``: MemGuard's figures for a smaller micro-batch, where known;
        ``situation``: what happened on the card (its capacity, other processes' memory, the peak judged)."""
        if why not in WHY:
            raise ValueError(f"`why` must be one of {WHY}, got {why!r}")
        situation = situation or Situation()
        others = situation.others or 0
        own = memory.peak
        peak = own + others
        parts = {
            "weights": memory.weights,
            "gradients": memory.gradients,
            "optimizer": memory.optimizer,
            "activations": memory.activations,
        }
        split = {**parts, "rest": max(0, own - sum(parts.values())), "others": others}
        largest = [] if memory.compiled else sorted(memory.forward.saved.items(), key=lambda kv: -kv[1])[:TOP]
        if memory.compiled:
            compiled = (
                "the model runs compiled: its graph saves its tensors as one, so modules are not told apart (measure"
                " it once without torch.compile, or with `memguard sweep --report`)"
            )
            note = f"{note}; {compiled}" if note else compiled
        top: list[dict[str, Any]] = [
            {
                "name": name,
                "class": memory.classes.get(name, "") if name else "",  # "": code outside every module
                "bytes": size,
                "share": size / peak if peak else 0.0,
            }
            for name, size in largest
        ]
        names = [t["name"] for t in top]
        shares = [t["share"] for t in top]
        resting = memory.weights + memory.gradients + memory.optimizer
        capacity = situation.capacity
        # this process's part of the peak judged, where the trigger's reading was higher than the step measured again
        judged_own = max(own, situation.judged - others) if situation.judged is not None else own
        causes = (rules.others_fix(judged_own, others, capacity), rules.resting_fix(resting, capacity, others))
        found = rules.fixes(
            names, memory.blocks, memory.vocabularies, memory.optimizer, peak, advice, shares,
            [c for c in causes if c is not None], memory.plain,
        )  # fmt: skip
        if situation.grew_back is not None:  # the step fits: nothing to fix
            found = []
            grew = f"{situation.grew_back}: this step fits, nothing to fix"
            note = f"{note}; {grew}" if note else grew
        if memory.scale > 1:
            scaled = f"measured on 1/{memory.scale:.3g} of the batch, activations scaled x{memory.scale:.3g}"
            note = f"{note}; {scaled}" if note else scaled
        return cls(
            why, step, memory.device, peak, memory.peak_measured, split, top, found, _timeline(memory, names),
            memory.samples, memory.scale, note, None, situation.capacity, situation.others, situation.judged,
            situation.batch,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": VERSION, "why": self.why, "step": self.step, "device": self.device, "samples": self.samples,
            "scale": self.scale, "note": self.note, "peak": self.peak, "peak_measured": self.peak_measured,
            "split": dict(self.split), "top": [dict(t) for t in self.top], "fixes": list(self.fixes),
            "timeline": [dict(p) for p in self.timeline], "snapshot": self.snapshot, "capacity": self.capacity,
            "other_processes": self.other_processes, "judged_peak": self.judged_peak, "batch": self.batch,
        }  # fmt: skip

    def verdict(self, situation: bool = True) -> str:
        """A few lines: what happened on the card (where known, and ``situation``), the split of the peak (other
        processes' memory first where it is the cause), the largest modules, the first fix.

        Example:
            >>> GB = 10**9
            >>> report = MemoryReport("spill", 7, "cuda:0", 10 * GB, True,
            ...     {"weights": GB, "gradients": GB, "optimizer": 0, "activations": 8 * GB, "rest": 0},
            ...     [{"name": "stem.conv", "class": "Conv2d", "bytes": 6 * GB, "share": 0.6}], ["a smaller batch"])
            >>> print(report.verdict())  # doctest: +NORMALIZE_WHITESPACE
            Memory at step 7 (spill): peak 10.00 GB = activations 8.00 GB (80%), weights 1.00 GB (10%),
            gradients 1.00 GB (10%)
            Largest saved activations: stem.conv (Conv2d) 6.00 GB (60%)
            Fix: a smaller batch
        """
        size = size_formatter(self.peak, 2)
        at = f"at step {self.step} " if self.step is not None else ""
        parts = sorted(((k, v) for k, v in self.split.items() if v > 0), key=lambda kv: -kv[1])
        if self.others_cause:
            parts.sort(key=lambda kv: kv[0] != "others")
        shares = ", ".join(f"{_PART.get(k, k)} {size(v)} ({v / self.peak:.0%})" for k, v in parts) if self.peak else ""
        measured = "" if self.peak_measured else " (the sum of the parts)"
        happened = self.happened() if situation else None
        lines = [happened] if happened else []
        lines.append(f"Memory {at}({self.why}): peak {size(self.peak)}{measured} = {shares}")
        if self.top:
            modules = ", ".join(f"{_named(t)} {size(t['bytes'])} ({t['share']:.0%})" for t in self.top)
            lines.append(f"Largest saved activations: {modules}")
        if self.note:
            lines.append(f"({self.note})")
        if self.fixes:
            lines.append(f"Fix: {self.fixes[0]}")
        return "\n".join(lines)

    @property
    def others_cause(self) -> bool:
        """Whether other processes' memory is the cause: without it this process's peak, or at least its weights,
        gradients and optimizer state, would fit the card."""
        others, capacity = self.split.get("others", 0), self.capacity
        peak = max(self.peak, self.judged_peak or 0)
        if not others or capacity is None or peak <= capacity:
            return False
        resting = sum(self.split.get(k, 0) for k in ("weights", "gradients", "optimizer"))
        return peak - others <= capacity or resting < capacity <= resting + others

    def happened(self) -> str | None:
        """What happened on the card, in the figures (and unit) a spill's message gives: the peak judged against
        the capacity, by how much it overflowed, the batch, other processes' memory; None where the capacity is
        unknown.

        Example:
            >>> MB = 10**6
            >>> MemoryReport("spill", 2, "cpu", 72 * MB, False, {}, [], [], capacity=63_200_000, other_processes=0,
            ...     judged_peak=72_800_000, batch=16).happened()
            'Spill at step 2: peak 72.8 MB against 63.2 MB of physical memory, 9.6 MB over; batch 16; others 0.0 MB'
        """
        capacity = self.capacity
        if capacity is None:
            return None
        size = size_formatter(capacity, gb_digits=2)
        judged = self.judged_peak if self.judged_peak is not None else self.peak
        at = f" at step {self.step}" if self.step is not None else ""
        room = f"{size(judged - capacity)} over" if judged > capacity else f"{size(capacity - judged)} free"
        batch = f"; batch {self.batch}" if self.batch is not None else ""
        others = "unknown" if self.other_processes is None else size(self.other_processes)
        happened = f"{_HAPPENED[self.why]}{at}: peak {size(judged)} against {size(capacity)} of physical memory"
        return f"{happened}, {room}{batch}; others {others}"

    def write(
        self, folder: str | os.PathLike[str], stem: str, snapshot: Callable[[str], None] | None = None
    ) -> list[str]:
        """Write ``<stem>.json`` and ``<stem>.html`` into ``folder`` (made if missing), each whole or not at all;
        with ``snapshot`` (a function writing PyTorch's allocator snapshot to a path) also ``<stem>.pickle``.
        Returns the paths written."""
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        paths = []
        if snapshot is not None:
            path = os.path.join(folder, f"{stem}.pickle")
            with written_atomically(path) as temporary:
                snapshot(temporary)
            self.snapshot = os.path.basename(path)
            paths.append(path)
        for suffix, text in (("json", json.dumps(self.to_dict(), indent=1)), ("html", self.html())):
            path = os.path.join(folder, f"{stem}.{suffix}")
            with written_atomically(path) as temporary, open(temporary, "w", encoding="utf-8") as f:
                f.write(text)
            paths.append(path)
        return _ordered(paths)

    def html(self) -> str:
        """One self-contained page: the verdict, an inline SVG of the forward pass's saved memory by module, the
        split and the top modules as tables. No script, no style sheet or font from elsewhere."""
        size = size_formatter(self.peak, 2)
        rows = "".join(
            f"<tr><td>{html.escape(_PART.get(k, k))}</td><td>{size(v)}</td><td>{v / self.peak:.1%}</td></tr>"
            for k, v in self.split.items()
            if self.peak
        )
        top = "".join(
            f"<tr><td>{html.escape(t['name'] or OUTSIDE_LABEL)}</td><td>{html.escape(t['class'])}</td>"
            f"<td>{size(t['bytes'])}</td><td>{t['share']:.1%}</td></tr>"
            for t in self.top
        )
        fixes = "".join(f"<li>{html.escape(f)}</li>" for f in self.fixes) or "<li>none: nothing to fix</li>"
        card = "".join(f"<tr><td>{name}</td><td>{html.escape(value)}</td></tr>" for name, value in self._card_rows())
        title = f"MemGuard memory report: {self.why}" + (f" at step {self.step}" if self.step is not None else "")
        return (
            '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>'
            f"{html.escape(title)}</title>\n<style>body{{font-family:sans-serif;margin:2em;max-width:60em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
            "pre{white-space:pre-wrap}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1>\n<pre>{html.escape(self.verdict())}</pre>\n"
            f"<h2>What happened on the card</h2>\n<table>{card}</table>\n"
            f"<h2>Saved activations over the forward pass, by module</h2>\n{self.svg()}\n"
            f"<h2>The peak, split</h2>\n<table><tr><th>part</th><th>bytes</th><th>share</th></tr>{rows}</table>\n"
            "<h2>Largest saved activations</h2>\n<table><tr><th>module</th><th>class</th><th>bytes</th>"
            f"<th>share of peak</th></tr>{top}</table>\n<h2>Fixes</h2>\n<ul>{fixes}</ul>\n"
            f"<p>{html.escape(self.note)}</p>\n</body></html>\n"
        )

    def _card_rows(self) -> list[tuple[str, str]]:
        """The page's table of what happened: capacity, the peak judged and by how much it passed the capacity, the
        batch, other processes' memory, this process's measured peak."""
        size = size_formatter(self.capacity or self.peak, 2)
        judged = self.judged_peak if self.judged_peak is not None else self.peak
        unknown = "unknown"
        rows = [
            ("the card's capacity (judged against)", size(self.capacity) if self.capacity is not None else unknown),
            ("the peak judged (this process and other processes)", size(judged)),
        ]
        if self.capacity is not None:
            over = judged - self.capacity
            rows.append(("over the capacity by" if over > 0 else "below the capacity by", size(abs(over))))
        rows += [
            ("the batch (samples)", str(self.batch) if self.batch is not None else unknown),
            ("samples measured (the largest micro-batch, or a part)", str(self.samples) if self.samples else unknown),
            ("other processes' memory", size(self.other_processes) if self.other_processes is not None else unknown),
            ("this step measured again: this process's peak", size(self.peak - self.split.get("others", 0))),
        ]
        return rows

    def svg(self, width: int = 800, height: int = 300) -> str:
        """Stacked areas: the saved bytes so far of each top module and of the others, at each module's forward
        end."""
        points = self.timeline
        names = [t["name"] for t in self.top] + ["other"]
        labels = [(n or OUTSIDE_LABEL) for n in names[:-1]] + ["other"]
        highest = max([p["saved"] for p in points] + [1])
        left, bottom = 60, height - 30
        if not points:
            return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"></svg>'
        step = (width - left - 160) / max(len(points) - 1, 1)
        shapes, legend = [], []
        below = [0] * len(points)
        for i, name in enumerate(names):
            above = [b + p["by_module"].get(name, 0) for b, p in zip(below, points, strict=True)]

            def y(v: int) -> float:
                return bottom - v / highest * (bottom - 10)

            top_edge = [f"{left + j * step:.1f},{y(v):.1f}" for j, v in enumerate(above)]
            bottom_edge = [f"{left + j * step:.1f},{y(v):.1f}" for j, v in reversed(list(enumerate(below)))]
            colour = _COLOURS[min(i, len(_COLOURS) - 1)]
            shapes.append(f'<polygon points="{" ".join(top_edge + bottom_edge)}" fill="{colour}"/>')
            legend.append(
                f'<rect x="{width - 150}" y="{14 + 18 * i}" width="12" height="12" fill="{colour}"/>'
                f'<text x="{width - 134}" y="{24 + 18 * i}" font-size="11">{html.escape(labels[i][:22])}</text>'
            )
            below = above
        size = size_formatter(highest, 2)
        axis = (
            f'<line x1="{left}" y1="{bottom}" x2="{width - 160}" y2="{bottom}" stroke="#333"/>'
            f'<line x1="{left}" y1="10" x2="{left}" y2="{bottom}" stroke="#333"/>'
            f'<text x="4" y="16" font-size="11">{size(highest)}</text>'
            f'<text x="{left}" y="{height - 10}" font-size="11">forward pass, module by module</text>'
        )
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">'
            f"{''.join(shapes)}{axis}{''.join(legend)}</svg>"
        )


_PART = {"others": "other processes"}  # a split's key as the verdict and the page name it


def _named(top: dict[str, Any]) -> str:
    """A top module as the verdict names it: its name and class, or the words for code outside every module."""
    if not top["name"]:
        return OUTSIDE_LABEL
    return f"{top['name']} ({top['class']})" if top["class"] else top["name"]


def _ordered(paths: list[str]) -> list[str]:
    """JSON first, then the page, then the snapshot."""
    order = {".json": 0, ".html": 1, ".pickle": 2}
    return sorted(paths, key=lambda p: order.get(os.path.splitext(p)[1], 3))


def _timeline(memory: StepMemory, top: list[str]) -> list[dict[str, Any]]:
    """At each module's forward end: the saved bytes so far, in all and by top module (the rest as ``"other"``)."""
    forward = memory.forward
    totals = dict.fromkeys([*top, "other"], 0)
    points, done = [], 0
    for module, events, allocated in forward.marks:
        for name, size in forward.events[done:events]:
            totals[name if name in totals and name != "other" else "other"] += size
        done = events
        points.append(
            {"module": module, "saved": sum(totals.values()), "allocated": allocated, "by_module": dict(totals)}
        )
    return points
