"""Useful work in the plan: how much of each step is padding, the examples per hour, epochs and hours that follow
from the run's rows per hour, and what packing would save — from the tokenize stage's report of the training rows.

"Useful" tokens are the non-padding tokens of the input rows (with packing, every packed example's tokens, prompt
included), as the training logs count them (`progress.step_throughput`). A step costs the same with or without
padding (the rows have a fixed length), so packing changes the examples a step carries, not its time.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Padding:
    """The training rows at the plan's length, as the tokenize report counts them."""

    efficiency: float  # non-padding share of a row, laid out as the run lays them out (`tokenize.pack`)
    unpacked: float  # ... with one example a row
    packed: float  # ... packed (first-fit decreasing)
    examples: int  # examples kept
    mean_length: float  # tokens of an example, before truncation

    @property
    def examples_per_row(self) -> float:
        return self.efficiency / self.unpacked  # a row of one example holds `unpacked` of its slots

    @property
    def rows(self) -> int:
        return max(1, round(self.examples / self.examples_per_row))


def padding_of(report: dict | None, pack: bool, seq_len: int) -> tuple[Padding | None, str | None]:
    """(the training split's padding, None) from a tokenize report; (None, why) when it cannot say."""
    if not report:
        return None, "no tokenize report in this output root yet: the tokenize stage writes it"
    train = report["train"]
    if train.get("max_length") != seq_len:
        return None, (f"the tokenize report is for rows of {train.get('max_length')} tokens and this plan's are "
                      f"{seq_len}: rerun the tokenize stage")
    if "padding_efficiency_packed" not in train:
        return None, "the tokenize report predates its packing estimate: rerun the tokenize stage"
    if not train["examples_out"]:
        return None, "the tokenize report has no training examples"
    packed = train["padding_efficiency_packed"]
    return Padding(
        efficiency=packed if pack else train["padding_efficiency_unpacked"],
        unpacked=train["padding_efficiency_unpacked"],
        packed=packed,
        examples=train["examples_out"],
        mean_length=train["mean_length"],
    ), None


def summary(job, row, warn_below: float, hours_for_steps) -> dict:
    """Tokens/s (every slot and the useful ones), MFU both ways, examples per hour, epochs and hours of `job` (a
    `job.Job`) on `row` (its `plan.Row`); the padding-dependent figures are None without a report. When the padding
    efficiency is under `warn_below` without packing, `packing` and `warning` say what packing would save
    (`hours_for_steps(steps)`: the hours of the same run in that many steps)."""
    padding = job.padding
    per_row = examples_per_row(job)
    efficiency = padding.efficiency if padding else None
    rows_trained = row.steps * row.global_batch
    tokens_per_sec = row.samples_per_hour / 3600 * job.seq_len
    out = {
        "padding_efficiency": efficiency,
        "padding_fraction": 1 - efficiency if padding else None,
        "padding_note": job.padding_note,
        "packed": job.pack,
        "tokens_per_sec": tokens_per_sec,
        "useful_tokens_per_sec": tokens_per_sec * efficiency if padding else None,
        "mfu": row.mfu,
        "useful_mfu": row.mfu * efficiency if padding else None,
        "examples_per_row": per_row,
        "examples_per_hour": row.samples_per_hour * per_row if per_row else None,
        "examples": rows_trained * per_row if per_row else None,
        "epochs": rows_trained / job.train_rows if job.train_rows else None,
        "hours": row.hours,
        "session_quote": session_quote(row, per_row),
    }
    if padding and not job.pack and padding.efficiency < warn_below:
        gain = padding.packed / padding.efficiency
        steps = max(1, round(row.steps / gain))  # the same examples in fewer, fuller rows; a step costs the same
        out["packing"] = {"padding_efficiency": padding.packed, "examples_per_step": gain, "steps": steps,
                          "hours": hours_for_steps(steps)}
        same = f"the same {out['epochs']:.1f} epochs" if out["epochs"] else "the same examples"
        out["warning"] = (
            f"padding efficiency {efficiency:.2f}: {1 - efficiency:.0%} of each step is padding; `tokenize.pack: true` "
            f"would make each step carry ~{gain:.1f}x more examples (packed efficiency {padding.packed:.2f}): {same} "
            f"in ~{hours_text(out['packing']['hours'])} instead of {hours_text(row.hours)}"
        )
    return out


def examples_per_row(job) -> float | None:
    """From the tokenize report; unpacked, one; packed without a report, `plan.train_examples` over its rows."""
    if job.padding:
        return job.padding.examples_per_row
    if not job.pack:
        return 1.0
    return job.train_examples / job.train_rows if job.train_examples and job.train_rows else None


def session_quote(row, per_row: float | None) -> str | None:
    """This plan's examples in one session of the row's hardware, beside the estimate quoted for it (a seed's)."""
    hw = row.hw
    if not hw.quoted_estimate or not row.steps_per_session:
        return None
    # packed rows without a report: their examples are not known, the rows are
    unit, per_row = ("examples", per_row) if per_row else ("packed rows", 1.0)
    in_session = row.steps_per_session * row.global_batch * per_row
    return (f"this plan: {row.samples_per_hour * per_row:,.0f} {unit}/h -> {in_session:,.0f} {unit} in a "
            f"{hw.session_hours:g} h session (after set-up and checkpoints); {hw.quoted_estimate}")


def hours_text(h: float) -> str:
    return f"{h * 60:.0f} min" if h < 1 else f"{h:,.1f} h"


def markdown_lines(out: dict, profile: str, padding: Padding | None) -> list[str]:
    """The plan's paragraph on useful work (the packing warning is among the plan's warnings)."""
    if padding:
        source = (f"the tokenize report: {padding.examples:,} examples of {padding.mean_length:,.0f} tokens on "
                  f"average, padding efficiency {out['padding_efficiency']:.3f}")
        rates = (f"{out['tokens_per_sec']:,.0f} tokens/s computed, {out['useful_tokens_per_sec']:,.0f} of them useful "
                 f"({out['padding_fraction']:.0%} padding); MFU {out['mfu']:g} assumed, {out['useful_mfu']:.3g} "
                 "counting useful tokens only")
    else:
        source = f"padding not counted: {out['padding_note']}"
        rates = f"{out['tokens_per_sec']:,.0f} tokens/s computed, padding included; MFU {out['mfu']:g} assumed"
    examples = ("examples per hour unknown (packed rows: the tokenize report or plan.train_examples counts them)" if out["examples_per_hour"] is None
                else f"{out['examples_per_hour']:,.0f} examples/h: {out['examples']:,.0f} examples")
    epochs = f", {out['epochs']:.1f} epochs" if out["epochs"] else ""
    lines = [f"**Useful work on {profile}** ({source}): {rates}. {examples}{epochs} in {hours_text(out['hours'])}."]
    if out.get("session_quote"):
        lines += ["", f"**A session on {profile}:** {out['session_quote']}."]
    return lines
