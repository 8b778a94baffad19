"""Progress of long work (SFT, preference, GRPO, generation): step, loss, tokens/s and time left; and the
per-step throughput metrics (step time, tokens/s, MFU, device memory) SFT and preference log.

Training throughput is counted twice: every token slot of the fixed-length rows (`tokens_per_sec`, `mfu`: the
work the devices do) and the useful ones only (`useful_tokens_per_sec`, `useful_mfu`): the non-padding tokens of
the input rows, i.e. those with a segment id (with packing, every packed example's tokens, prompt included), at
the same FLOPs per token. `padding_fraction` is the share of the step that was padding.

In a terminal or a notebook a tqdm bar shows it: Tunix's own trainer bar (to which
`upstream.trainer_class` adds useful and padded tokens/s), or ours for generation. Where nothing is
interactive (a log file, a batch job, a notebook run as a script) a bar draws
nothing, so a line is logged every tenth of the run (at most one each `min_seconds`)
and at least once a minute, e.g.
`sft: step 40/1000 (4%), loss 1.2345, 1,070 useful tokens/s of 5,432 (80% padding), 1:23:45 left`.
"""

from __future__ import annotations

import datetime
import logging
import sys
import time

import jax
from tqdm import auto
from tunix.sft import hooks

log = logging.getLogger(__name__)


def interactive() -> bool:
    """Where a tqdm bar shows: a terminal on stderr, or IPython (the rule Tunix's trainer bar follows)."""
    ipython = sys.modules.get("IPython")
    if ipython is not None and getattr(ipython, "get_ipython", lambda: None)() is not None:
        return True
    return sys.stderr.isatty()


class Progress:
    """Reports steps `start+1 … total` of `label`: a bar (`bar=True`, interactive only), else log lines."""

    def __init__(self, label: str, total: int, start: int = 0, every: int | None = None, bar: bool = False,
                 unit: str = "step", seconds: float = 60.0, min_seconds: float = 10.0):
        self.label, self.total, self.unit = label, total, unit
        self.seconds, self.min_seconds = seconds, min_seconds
        self.every = every or max(1, (total - start) // 10)
        self.lines = not interactive()
        self.bar = None
        if bar and not self.lines:
            self.bar = auto.tqdm(total=total, initial=start, desc=label, unit=unit, dynamic_ncols=True)
        self.first: tuple[int, float] | None = None  # (step, time) of the first report: timing starts there
        self.printed: tuple[int, float] = (start, time.perf_counter())

    def update(self, step: int, loss: float | None = None, tokens_per_sec: float | None = None,
               padded_tokens_per_sec: float | None = None) -> None:
        """`tokens_per_sec`: the tokens that count (generated, or the non-padding ones of training rows);
        `padded_tokens_per_sec`: training's rate with the padding, shown beside it."""
        now = time.perf_counter()
        if self.first is None:
            self.first = (step, now)  # its step compiled: the rate is timed from here on
        if self.bar is not None:
            rate = "useful tokens/s" if padded_tokens_per_sec is not None else "tokens/s"
            self.bar.set_postfix({k: v for k, v in (("loss", loss), (rate, tokens_per_sec)) if v is not None})
            self.bar.update(step - self.bar.n)
        if not self.lines:
            return
        last_step, last_time = self.printed
        due = (
            step >= self.total
            or now - last_time >= self.seconds
            or (step - last_step >= self.every and now - last_time >= self.min_seconds)
        )
        if step == self.first[0] or due:
            self.printed = (step, now)
            log.info("%s", self.line(step, now, loss, tokens_per_sec, padded_tokens_per_sec))

    def line(self, step: int, now: float, loss: float | None, tokens_per_sec: float | None,
             padded_tokens_per_sec: float | None = None) -> str:
        parts = [f"{self.label}: {self.unit} {step}/{self.total} ({step / max(self.total, 1):.0%})"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if tokens_per_sec is not None and padded_tokens_per_sec:
            padding = 1 - tokens_per_sec / padded_tokens_per_sec
            parts.append(f"{tokens_per_sec:,.0f} useful tokens/s of {padded_tokens_per_sec:,.0f} "
                         f"({padding:.0%} padding)")
        elif tokens_per_sec is not None:
            parts.append(f"{tokens_per_sec:,.0f} tokens/s")
        first_step, first_time = self.first
        if step > first_step:
            left = (now - first_time) / (step - first_step) * (self.total - step)
            parts.append(f"{datetime.timedelta(seconds=round(left))} left")
        return ", ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def training_hooks(label: str):
    """A Tunix `TrainingHooks` reporting each step of the trainer it is attached to (GRPO's actor: no tokens/s)."""
    class Report(hooks.TrainingHooks):
        def __init__(self):
            self.progress: Progress | None = None

        def on_train_start(self, trainer):
            if self.progress is None:  # RL trainers start once per rollout batch: one report for the run
                self.progress = Progress(label, trainer.config.max_steps, trainer.train_steps)

        def on_train_step_end(self, trainer, train_step, train_loss):
            loss = None if train_loss is None else float(train_loss)
            self.progress.update(train_step, loss)
        def on_train_end(self, trainer): ...
        def on_train_step_start(self, trainer): ...
        def on_eval_step_start(self, trainer): ...
        def on_eval_step_end(self, trainer, eval_loss): ...

    return Report()


def step_throughput(seconds: float, padded_tokens: int, useful_tokens: int, flops_per_token: float,
                    peak_flops: float | None, devices: int) -> dict:
    """One optimizer step's rates: every token slot it computed (`padded_tokens`) and the non-padding ones among
    them (`useful_tokens`); MFU for both at the same FLOPs per token (None without a peak to divide by)."""
    out = {
        "step_time": seconds,
        "tokens_per_sec": padded_tokens / seconds,
        "useful_tokens_per_sec": useful_tokens / seconds,
        "padding_fraction": 1 - useful_tokens / padded_tokens,
    }
    if peak_flops:
        out["mfu"] = padded_tokens * flops_per_token / seconds / (peak_flops * devices)
        out["useful_mfu"] = useful_tokens * flops_per_token / seconds / (peak_flops * devices)
    return out


def throughput_hooks(step_tokens, flops_per_token: float, peak_flops: float | None, devices: int):
    """Tunix `TrainingHooks` logging `step_throughput` and device memory each optimizer step, and reporting progress.

    `step_tokens(step)`: (token slots, non-padding tokens) of optimizer step `step` (1-based, as Tunix numbers them
    here), every micro-batch and every process's rows included (`loop.BatchFeed.step_tokens`).
    """
    class Throughput(hooks.TrainingHooks):
        def __init__(self):
            self.last, self.progress = None, None

        def on_train_start(self, trainer):
            self.last = None
            self.progress = Progress(trainer.config.pbar_description, trainer.config.max_steps, trainer.train_steps)

        def on_train_step_end(self, trainer, train_step, train_loss):
            now = time.perf_counter()
            metrics = {}
            if self.last is not None:  # the first step compiles: timed from the second on
                slots, useful = step_tokens(train_step)
                metrics = step_throughput(now - self.last, slots, useful, flops_per_token, peak_flops, devices)
                stats = jax.local_devices()[0].memory_stats() or {}
                if "bytes_in_use" in stats:
                    metrics["device_memory_gb"] = stats["bytes_in_use"] / 1e9
                for name, value in metrics.items():
                    trainer.metrics_logger.log(trainer.metrics_prefix, name, value, "train", train_step)
            loss = None if train_loss is None else float(train_loss)  # written a step late: already on the host
            self.progress.update(train_step, loss, metrics.get("useful_tokens_per_sec"), metrics.get("tokens_per_sec"))
            self.last = now
        def on_train_end(self, trainer): ...
        def on_train_step_start(self, trainer): ...
        def on_eval_step_start(self, trainer): ...
        def on_eval_step_end(self, trainer, eval_loss): ...

    return Throughput()
