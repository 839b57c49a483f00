"""--lora-variant (DoRA, rsLoRA) and --average-checkpoints.

* DoRA trains a magnitude per adapted output beside A and B; with non-reentrant checkpointing
  its gradients are exactly those without (as LoRA's, tests/test_checkpointing_parity.py), and
  final/'s merge (peft's merge_and_unload, magnitudes included) gives the adapter model's
  outputs. rsLoRA scales the update by alpha / sqrt(r).
* Averaging N checkpoints gives their mean weights; the average is evaluated on the run's sets
  and kept as final/ only where it wins by the run's rule (the judge's), said in one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import metric_rows
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file
from tiny_models import (
    fresh_short_whisper,
    make_tiny_whisper,
    nonzero_lora_b,
    tiny_batch,
    trainable_gradients,
)

from whisper_train.memory import (
    LoraSettings,
    checkpointing_policy,
    checkpointing_state,
    prepare_model,
    training_loss,
)
from whisper_train.models import load_model
from whisper_train.training import judge as judge_module
from whisper_train.training.averaging import average_weights
from whisper_train.training.checkpoints import STATE_FILE, WEIGHTS_FILE
from whisper_train.training.final import save_final
from whisper_train.training.train import train

DORA = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj", "v_proj"), variant="dora")
FLOAT32_EPS = torch.finfo(torch.float32).eps


def dora_model(checkpointing: str = "off"):
    """A seeded tiny Whisper with DoRA adapters whose B and magnitudes are moved off their
    initial values (peft starts B at zero and each magnitude at its weight's norm, where DoRA
    changes nothing), as after some training."""
    model = fresh_short_whisper("sdpa")
    torch.manual_seed(1)  # A's initialisation
    model = nonzero_lora_b(
        prepare_model(model, mode="lora", checkpointing=checkpointing, lora=DORA)
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return model.train()


def magnitudes(model) -> list[str]:
    return [n for n, p in model.named_parameters() if "lora_magnitude_vector" in n]


def test_dora_gradients_with_checkpointing_equal_those_without():
    runs = {}
    for policy in ("off", "full"):
        model = dora_model(policy)
        loss = training_loss(model, tiny_batch())
        loss.backward()
        runs[policy] = (loss.detach(), trainable_gradients(model), model)
    loss, grads, model = runs["full"]
    state = checkpointing_state(model)
    assert state["enabled"] and not state["reentrant"], state
    # DoRA trains a magnitude per adapted layer (q_proj and v_proj of each of 4 layers' 2 or 3
    # attentions), each with a gradient, beside A and B.
    assert magnitudes(model), "no DoRA magnitude vectors: --lora-variant dora was not applied"
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in magnitudes(model))
    # Bitwise, as LoRA's parity: the recompute runs the same ops on the same inputs.
    reference_loss, reference = runs["off"][0], runs["off"][1]
    assert torch.equal(loss, reference_loss)
    unequal = [n for n, g in grads.items() if not torch.equal(g, reference[n])]
    assert not unequal, unequal[:5]


def test_final_merges_dora_into_weights_that_give_the_adapter_models_outputs(tmp_path):
    model = dora_model().eval()
    assert magnitudes(model), "no DoRA magnitude vectors to merge"
    batch = tiny_batch()
    inputs = {k: batch[k] for k in ("input_features", "decoder_input_ids")}
    with torch.no_grad():
        adapted = model(**inputs).logits
        plain = model.get_base_model()
        with model.disable_adapter():
            base = plain(**inputs).logits
    _, processor = make_tiny_whisper()
    final = save_final(model, processor, tmp_path / "final", pin_language=False, config_yaml="")
    merged, _ = load_model(str(final))
    with torch.no_grad():
        merged_logits = merged.eval()(**inputs).logits
    scale = adapted.abs().max().item()
    # The adapters change the outputs by far more than the tolerance below: the test compares
    # a model that DoRA changed, not the base model with itself.
    assert (adapted - base).abs().max().item() > 1e-3 * scale
    # Merged, W' = m (W + s B A) / ||W + s B A|| is computed once in float32 where the adapter
    # model computes m / ||.|| x (W x + s B A x) at every layer: the two differ by rounding,
    # float32's epsilon per operation accumulated over d_model-long sums (64 here) through 8
    # layers: 1e-4 of the logits' scale bounds it (measured: 4.5e-7).
    torch.testing.assert_close(merged_logits, adapted, rtol=0, atol=1e-4 * scale)


def test_rslora_scales_the_update_by_alpha_over_the_root_of_r():
    settings = LoraSettings(r=4, alpha=8, dropout=0.0, targets=("q_proj",), variant="rslora")
    model = prepare_model(fresh_short_whisper("sdpa"), mode="lora", lora=settings)
    scalings = {
        module.scaling["default"] for module in model.modules() if isinstance(module, LoraLayer)
    }
    assert scalings == {8 / math.sqrt(4)}  # LoRA's would be 8 / 4


def test_a_lora_variant_that_does_not_exist_is_refused_in_one_line(tiny_run_config):
    from whisper_train.errors import UserError

    with pytest.raises(UserError, match=r"^--lora-variant vera: expected one of lora, dora"):
        tiny_run_config(mode="lora", lora_variant="vera").validate()


# -- averaged checkpoints ---------------------------------------------------------------------


def fake_checkpoint(folder, weights: dict) -> None:
    folder.mkdir(parents=True)
    save_file(weights, folder / WEIGHTS_FILE)
    (folder / STATE_FILE).write_text("{}")


def test_averaging_two_checkpoints_gives_their_mean_weights(tmp_path):
    generator = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 32, generator=generator), "b": torch.randn(32, generator=generator)}
    b = {name: 3 * torch.randn(t.shape, generator=generator) for name, t in a.items()}
    fake_checkpoint(tmp_path / "checkpoint-2", a)
    fake_checkpoint(tmp_path / "checkpoint-4", b)
    mean = average_weights([tmp_path / "checkpoint-2", tmp_path / "checkpoint-4"])
    assert set(mean) == set(a)
    for name in a:
        exact = (a[name].double() + b[name].double()) / 2
        assert mean[name].dtype == torch.float32
        # (a + b) / 2 in float32: one rounding of the sum (the halving is exact), within an
        # epsilon of the larger operand.
        bound = FLOAT32_EPS * torch.maximum(a[name].abs(), b[name].abs()).double()
        assert bool(((mean[name].double() - exact).abs() <= bound).all()), name


def averaged_run(tiny_run_config, monkeypatch, *, wins: bool, by: str = "last"):
    """A 2-step full fine-tuning of the tiny model (3 with `by` "best"), a checkpoint and an
    evaluation at each step, and 2 averaged. The average is evaluated for real; its primary
    WER is then put just above (`wins` False) or below (True) the best step's, which the random
    model's equal WERs could not decide. With "best", step 2's WER is made the worst (the
    random model's would tie): the best 2 are steps 1 and 3."""
    real, real_set = (
        judge_module.RunEvaluations.evaluate_average,
        judge_module.RunEvaluations._evaluate_set,
    )

    def evaluate_average(self, model, step, steps):
        rows = real(self, model, step, steps)
        best = min(r["wer"] for r in self.rows if r["step"] > 0 and r["set"] == "eval")
        rows[0]["wer"] = best + (-0.01 if wins else 0.01)
        return rows

    def evaluate_set(self, model, name, loader, step, averaged=None):
        row = real_set(self, model, name, loader, step, averaged)
        if by == "best" and not averaged:
            row["wer"] = {1: 0.30, 2: 0.90, 3: 0.50}.get(step, row["wer"])
        return row

    monkeypatch.setattr(judge_module.RunEvaluations, "evaluate_average", evaluate_average)
    monkeypatch.setattr(judge_module.RunEvaluations, "_evaluate_set", evaluate_set)
    config = tiny_run_config(
        max_steps=3 if by == "best" else 2,
        save_steps=1,
        eval_steps=1,
        eval_subset=1,
        only_train=False,
        average_checkpoints=2,
        average_by=by,
        save_total_limit=1 if by == "best" else 2,
        generation_max_length=2,
    )
    result = train(config)
    return result, config


def test_an_average_that_wins_is_kept_as_final(tiny_run_config, monkeypatch, tmp_path, capsys):
    result, _ = averaged_run(tiny_run_config, monkeypatch, wins=True)
    out = tmp_path / "out"
    assert result.final_averaged == [1, 2]
    expected = average_weights([out / "checkpoint-1", out / "checkpoint-2"])
    final = load_file(out / "final" / "model.safetensors")
    for name, weight in expected.items():
        if name in final:  # the output head is tied to the token embedding: saved once
            torch.testing.assert_close(final[name], weight, rtol=0, atol=0)
    averaged = [r for r in metric_rows(out) if r.get("averaged")]
    assert [r["set"] for r in averaged] == ["eval"] and averaged[0]["averaged"] == [1, 2]
    saved = json.loads((out / "result.json").read_text())
    assert saved["final_averaged"] == [1, 2]
    assert "the average of the checkpoints of steps 1, 2" in saved["final_reason"]
    assert (
        "final/ holds the average of the checkpoints of steps 1, 2"
        in (out / "final" / "README.md").read_text()
    )
    said = capsys.readouterr().out
    assert "final/: step 2: the average of the checkpoints of steps 1, 2" in said


def test_the_best_checkpoints_are_kept_and_averaged_and_a_losing_average_is_not_kept(
    tiny_run_config, monkeypatch, tmp_path, capsys
):
    """--average-by best: rotation keeps the best 2 evaluated steps' checkpoints beside the
    newest (1 and 3; 2 was the worst), they are averaged, and the average, losing, is
    evaluated and not kept."""
    result, _ = averaged_run(tiny_run_config, monkeypatch, wins=False, by="best")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    assert result.final_averaged is None
    assert [r["averaged"] for r in metric_rows(out) if r.get("averaged")] == [[1, 3]]
    # final/ holds the chosen step's own weights (step 1: the lowest WER).
    assert result.final_step == 1
    kept = load_file(out / f"checkpoint-{result.final_step}" / WEIGHTS_FILE)
    final = load_file(out / "final" / "model.safetensors")
    for name, weight in kept.items():
        if name in final:
            assert torch.equal(final[name], weight), name
    said = capsys.readouterr().out
    assert "averaging the checkpoints of steps 1, 3" in said
    assert "the average of steps 1, 3 does not beat step 1" in said


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"save_steps": 2, "save_total_limit": 1}, "raise --save-total-limit to 2"),
        ({}, "--save-steps"),
        ({"save_steps": 2, "only_train": True}, "--only-train"),
        ({"save_steps": 2, "fsdp": True, "nproc": 2}, "--fsdp"),
        ({"save_steps": 2, "average_by": "best"}, "add --eval-steps"),
        ({"save_steps": 2, "average_by": "worst"}, "--average-by"),
    ],
)
def test_averaging_what_the_run_cannot_average_is_refused_in_one_line(
    tiny_run_config, overrides, named
):
    from whisper_train.errors import UserError

    settings = {"only_train": False, "average_checkpoints": 2, **overrides}
    with pytest.raises(UserError) as refused:
        tiny_run_config(**settings).validate()
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_the_memory_estimate_counts_what_dora_keeps_for_backward():
    """DoRA keeps its layers' base and adapter outputs for the magnitude's gradient (45% more
    than LoRA on the tiny model, unchecked): `--gradient-checkpointing auto` plans with it."""
    from whisper_train.memory import plan as planner

    model, _ = make_tiny_whisper()
    settings = LoraSettings(variant="dora")
    model = prepare_model(model, mode="lora", checkpointing="full", lora=settings)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 80, 3000, generator=generator)
    tokens = torch.randint(0, 50000, (1, 20), generator=generator)
    with checkpointing_policy(model, "off"):  # every layer's activations kept
        measured = planner.probe_saved_bytes(model, features, tokens)
    counted = planner.count_saved_bytes(model, policy="off", label_tokens=20)["device"]
    # tests/test_memory_plan.py's tolerance for every mode (measured here: within 0.7%).
    assert counted == pytest.approx(measured, rel=0.15)


def test_the_average_is_judged_by_the_runs_rule_guard_and_ties_included():
    from whisper_train.training.final import (
        FinalChoice,
        FinalRule,
        choose_final_step,
        choose_with_average,
    )

    rows = [
        {"step": 0, "set": "target", "wer": 0.50},
        {"step": 0, "set": "guard", "wer": 0.10},
        {"step": 2, "set": "target", "wer": 0.30},
        {"step": 2, "set": "guard", "wer": 0.11},
    ]
    rule = FinalRule(primary_set="target", guard="guard", max_regression=2.0)
    chosen = choose_final_step(rows, rule)
    assert chosen.step == 2

    def judged(target: float, guard: float) -> FinalChoice:
        averaged = [
            {"step": 2, "set": "target", "wer": target},
            {"step": 2, "set": "guard", "wer": guard},
        ]
        return choose_with_average(rows, averaged, (1, 2), chosen, rule)

    assert judged(0.20, 0.115).averaged == (1, 2)  # lower, guard 1.5 points over its start
    assert judged(0.20, 0.125).averaged is None  # lower, but the guard 2.5 points over
    assert judged(0.30, 0.10) == chosen  # a tie keeps the step
