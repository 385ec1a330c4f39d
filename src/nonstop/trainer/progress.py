"""The console's live view of a run: a line per stage while the run is built (`build_lines`), then the progress bar
over its steps, whose postfix names the phase running and what it is at:

    train:  12%|██        | 3/25 [01:02<07:40, gen 12,345 tok, 37/64 running]

`validation 2/4`, `update_actor 3/8` (micro-batch k of K), `reward 12/64 pending`. The components that know the
detail (the engine's generate loop, the micro-batch passes, the reward pool's wait) get `ProgressBar.detail` as a
plain callable, or None with the console off, and so neither import the trainer nor cost anything without a bar.
The bar is written from the trainer's thread only."""

from __future__ import annotations

from collections.abc import Callable


class ProgressBar:
    def __init__(self):
        self.bar = None  # the tqdm bar, from `start` to `close`
        self.name = ""

    def start(self, total_steps: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=initial, desc="train", unit="step")

    def phase(self, name: str) -> None:
        """The phase now running (the profiler's span names: gen, reward, update_actor, ...; `validation i/N`)."""
        self.name = name
        self._show(name)

    def detail(self, text: str) -> None:
        """What the phase running is at, shown after its name."""
        self._show(f"{self.name} {text}")

    def _show(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def write(self, line: str) -> None:
        """A line above the bar (a step's console line)."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance_to(self, step: int) -> None:
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def show_progress(trainer, progress: ProgressBar | None) -> None:
    """Show `trainer`'s run (a `Trainer`) on `progress` (None: nowhere): each phase's name as it opens, and what the
    phases that take long are at: validation i/N, the engine's generated tokens and running samples (where this
    rank's engine generates on the trainer's thread: `trainer.mode=sync`, and validation in every mode), each pass's
    micro-batch k/K, the rewards still pending."""
    trainer.log.progress = progress
    trainer.show_phase = progress.phase if progress is not None else None
    trainer.profiler.recorder.on_open = trainer.show_phase
    detail = progress.detail if progress is not None else None
    for part in (trainer.generation, trainer.actor, trainer.critic, trainer.scorer):
        if part is not None:
            part.progress = detail


def build_lines(console: bool) -> Callable[[str], None]:
    """Prints a line as each slow stage of building a run starts (loading the policy, building the engine, ...), so
    the minutes before the first step's bar are not silent; nothing without the console."""
    return (lambda line: print(line, flush=True)) if console else (lambda line: None)
