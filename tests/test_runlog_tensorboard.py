"""TensorBoard after --resume shows one run: the interrupted run's later steps are purged."""

from __future__ import annotations

from whisper_train.runlog import MetricsLog


def _scalars(folder) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder / "tensorboard"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars("train/loss")]


def test_resumed_steps_replace_the_interrupted_runs_in_tensorboard(tmp_path):
    first = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 5):  # the run got to step 4; its last checkpoint is step 2
        first.write({"step": step, "loss": 10.0 + step})
    first.close()

    resumed = MetricsLog(tmp_path, enabled=True, purge_step=3)
    for step in (3, 4):
        resumed.write({"step": step, "loss": 20.0 + step})
    resumed.close()

    # each step once, the resumed run's value (not both runs' steps 3 and 4)
    assert _scalars(tmp_path) == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
