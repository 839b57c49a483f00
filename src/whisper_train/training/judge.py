"""A run's evaluations and what they decide, apart from the step loop: each evaluation scores
every set as `evaluate` decodes it (`RunEvaluations.evaluate`), what is measured before the
first step (`measure_starts`: step 0, or on --resume the sets and the guard it added), the
verdicts of the guard and of each non-speech set (the words it invents, held to its start) on
each evaluation, and which evaluated step final/ holds (`final_choice`).
"""

from __future__ import annotations

from collections.abc import Callable

from accelerate.utils import send_to_device

from whisper_train import memory
from whisper_train.config.record import EvaluationRecord
from whisper_train.evaluation.evaluate import run_evaluation
from whisper_train.evaluation.longform import run_long_form_evaluation
from whisper_train.evaluation.nonspeech import evaluate_nonspeech_examples
from whisper_train.runlog import say
from whisper_train.training.final import (
    FinalChoice,
    FinalRule,
    choose_final_step,
    choose_with_average,
    guard_regression,
    nonspeech_rise,
    ranked_steps,
)


class RunEvaluations:
    """Every evaluation of one run: its rows (metrics.jsonl's, and what a checkpoint keeps),
    the guard's start, and the sets' loaders and languages."""

    def __init__(
        self,
        evaluation: EvaluationRecord,
        *,
        loaders: dict,
        languages: dict,
        processor,
        normalizer,
        accelerator,
        metrics,
        table,
        complete: Callable[[dict], dict] | None = None,
        rows: list[dict] = (),
        guard_start: dict | None = None,
    ):
        self.evaluation = evaluation
        self.loaders, self.languages = loaders, languages
        self.processor, self.normalizer = processor, normalizer
        self.accelerator, self.metrics, self.table = accelerator, metrics, table
        # Batches completed with their frozen encoder's outputs (the encoder cache), or None.
        self.complete = complete
        self.rows = list(rows)
        # The rows of --average-checkpoints' average: no step to resume at, so kept apart.
        self.averaged_rows: list[dict] = []
        # The guard set and the step its later WERs are held against ({"set", "step"}).
        self.guard_start = guard_start

    @property
    def start_step(self) -> int:
        return (self.guard_start or {}).get("step", 0)

    def measured(self, step: int, name: str | None = None) -> bool:
        return any(r["step"] == step and name in (None, r.get("set")) for r in self.rows)

    def measure_starts(self, model, *, step: int, resumed: bool, new_sets: list[str]) -> bool:
        """What later evaluations are held against, measured before the first step trains:
        step 0 (with --eval-at-start, or for the guard), or on --resume the sets and the guard
        it added, at the step it starts from. True: the guard asks the run to stop."""
        evaluation, guard = self.evaluation, self.evaluation.guard
        if not resumed:
            self.guard_start = {"set": guard, "step": 0} if guard else None
            # A non-speech set is held to its start as the guard is: measured before step 1.
            if evaluation.eval_at_start or guard or evaluation.nonspeech_sets:
                return self.evaluate(model, 0)
            return False
        new = list(new_sets)
        if guard and (self.guard_start or {}).get("set") != guard:
            # Its start: step 0 where it was measured then, else the step it became the guard.
            start = 0 if self.measured(0, guard) else step
            self.guard_start = {"set": guard, "step": start}
            if start == step and guard not in new and not self.measured(step, guard):
                new.append(guard)
        return self.evaluate(model, step, only=new) if new else False

    def evaluate(self, model, step: int, *, only: list[str] | None = None) -> bool:
        """Every evaluation set (or those named in `only`): validation loss, generate-based
        WER, loop and insertion rates (a metrics line each, one table row), then the guard's
        verdict. True: --stop-on-regression asks the run to stop."""
        rows = []
        # --fsdp: each process decodes its own clips, a different number of forwards each, so
        # the weights are gathered whole for the evaluation (no collective inside a forward).
        with memory.gathered(model):
            for name, loader in self.loaders.items():
                if only is None or name in only:
                    rows.append(self._evaluate_set(model, name, loader, step))
        self.rows.extend(rows)
        self.table.row(rows)
        model.train()
        return self._guard_stops(step)

    def evaluate_average(self, model, step: int, steps: tuple[int, ...]) -> list[dict]:
        """The average of the checkpoints of `steps` (the last `step`), in `model`, scored on
        every set as a step is: its rows (marked `averaged`) are `averaged_rows`."""
        with memory.gathered(model):
            self.averaged_rows = [
                self._evaluate_set(model, name, loader, step, averaged=list(steps))
                for name, loader in self.loaders.items()
            ]
        self.table.row(self.averaged_rows)
        model.train()
        return self.averaged_rows

    def _evaluate_set(self, model, name: str, loader, step: int, averaged=None) -> dict:
        """One evaluation set's metrics row at `step`, written to metrics.jsonl."""
        evaluation, accelerator = self.evaluation, self.accelerator
        languages = self.languages[name]
        eval_set = evaluation.set_named(name)
        if eval_set.nonspeech:  # clips where nobody speaks: the words the model invents
            row = self._score_nonspeech(model, loader, languages)
        elif eval_set.long_form:  # whole recordings, decoded in 30 s windows
            row = run_long_form_evaluation(
                model,
                loader,
                self.processor,
                accelerator,
                self.normalizer,
                step,
                decoding=evaluation.decoding,
                condition_on_previous_text=evaluation.condition_on_previous_text,
                languages=languages,
            )
        else:
            batches = (send_to_device(batch, accelerator.device) for batch in loader)
            if self.complete is not None:  # batches complete with their encoder outputs
                batches = map(self.complete, batches)
            row = run_evaluation(
                model,
                batches,
                self.processor,
                accelerator,
                self.normalizer,
                evaluation.max_length,
                step,
                evaluation.decoding,
                languages=languages,
            )
        row = {"step": step, "set": name, **({"averaged": averaged} if averaged else {}), **row}
        self.metrics.write(row)
        return row

    def _score_nonspeech(self, model, examples, language: str | None) -> dict:
        """A non-speech set's row: every process decodes the whole set (a few clips; no
        collective, so none waits for another), decoded as `evaluate` decodes it."""
        evaluation = self.evaluation
        unwrapped = self.accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()
        scores = evaluate_nonspeech_examples(
            unwrapped,
            self.processor,
            examples,
            max_length=evaluation.max_length,
            decoding=evaluation.decoding,
            language=language,
        ).scores
        unwrapped.train(was_training)
        return {
            "words_per_minute": scores.words_per_minute,
            "share_with_text": scores.share_with_text,
            "words": scores.words,
            "clips": scores.clips,
            "audio_seconds": scores.seconds,
        }

    def _nonspeech_vetoes(self, step: int) -> None:
        """Say so, a line a set, when a non-speech set's words per minute rose past
        --max-nonspeech-rise over its start."""
        limit = self.evaluation.max_nonspeech_rise
        for name in self.evaluation.nonspeech_sets:
            rise = nonspeech_rise(self.rows, name, step)
            if rise is not None and rise[0] > limit:
                say(
                    self.accelerator,
                    f"non-speech set {name}: {rise[0]:+.1f} words per minute over its start "
                    f"(step {rise[1]}) at step {step}, past --max-nonspeech-rise {limit:g}: "
                    "this step will not go to final/",
                )

    def _guard_stops(self, step: int) -> bool:
        """Say so when the guard set's WER rose past --max-regression points over its start;
        True when --stop-on-regression then stops the run."""
        self._nonspeech_vetoes(step)
        evaluation = self.evaluation
        guard, start = evaluation.guard, self.start_step
        regression = guard_regression(self.rows, guard, step, start)
        if regression is None or regression <= evaluation.max_regression:
            return False
        stop = evaluation.stop_on_regression
        say(
            self.accelerator,
            f"guard {guard}: WER {regression:+.1f} points over its start (step {start}) at step "
            f"{step}, past --max-regression {evaluation.max_regression:g}: this step will not "
            "go to final/" + ("; stopping (--stop-on-regression)" if stop else ""),
        )
        return stop

    def final_rule(self) -> FinalRule:
        """What a model must hold to go to final/, said once so that a step and an average
        of checkpoints are judged alike."""
        return rule_of(self.evaluation, self.start_step)

    def final_choice(self) -> FinalChoice:
        return choose_final_step(self.rows, self.final_rule())

    def steps_to_keep(self, best: int) -> set[int]:
        """The evaluated steps whose checkpoints rotation keeps beside the newest: the one
        final/ would hold and the `best` best by the final rule (--average-by best's)."""
        chosen = self.final_choice().step
        ranked = ranked_steps(self.rows, self.final_rule())[:best]
        return {*ranked, *([chosen] if chosen is not None else [])}

    def choice_with_average(self, chosen: FinalChoice, steps: tuple[int, ...]) -> FinalChoice:
        """`chosen`, or the average of `steps` where it wins by the same rule (`final`)."""
        return choose_with_average(self.rows, self.averaged_rows, steps, chosen, self.final_rule())


def rule_of(evaluation: EvaluationRecord, guard_start: int) -> FinalRule:
    """The final rule of a run's evaluation record, its guard held to `guard_start`."""
    return FinalRule(
        primary_set=evaluation.primary,
        guard=evaluation.guard,
        max_regression=evaluation.max_regression,
        guard_start=guard_start,
        nonspeech_sets=evaluation.nonspeech_sets,
        max_nonspeech_rise=evaluation.max_nonspeech_rise,
    )
