"""The failure whisper-train protects against, shown on the transformers that has it.

`make test-compat` runs this module on transformers 4.56.2, where the stock recipe
(Seq2SeqTrainer with gradient_checkpointing=True and no kwargs) fails with "Trying to backward
through the graph a second time" (T1); on 5.x the same recipe trains, and the tests assert that
instead, so both runs assert something real. Either way, the same training through
`prepare_model` matches training without checkpointing bit for bit, and doctor tells the two
apart. The seed report's cases (a)-(c) are here too, plus the documented Trainer snippet (docs/checkpointing.md).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from tiny_models import LORA, fresh_short_whisper, pristine, short_tiny_whisper, tiny_batch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from whisper_train import doctor
from whisper_train.memory import (
    LoraSettings,
    build_optimizer,
    checkpointing_state,
    prepare_model,
)

pytestmark = pytest.mark.compat

AFFECTED = doctor.T1_AFFECTED[0] <= Version(transformers.__version__) < doctor.T1_AFFECTED[1]


def utterances(n: int = 4, n_mels: int = 80) -> list[dict[str, torch.Tensor]]:
    """`n` single utterances (features (n_mels, 100), labels (5,)) for a Trainer."""
    batches = [tiny_batch(seed, n_mels) for seed in range(n // 2 + n % 2)]
    rows = [
        {"input_features": b["input_features"][i], "labels": b["labels"][0]}
        for b in batches
        for i in range(2)
    ]
    return rows[:n]


def collator(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def trainer_args(tmp_path, **overrides) -> Seq2SeqTrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=2,
        max_steps=1,  # one step shows both the failure and the parity
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
        label_names=["labels"],
        seed=0,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return Seq2SeqTrainingArguments(**values)


def train_with_trainer(model, args) -> torch.nn.Module:
    trainer = Seq2SeqTrainer(
        model=model, args=args, train_dataset=utterances(), data_collator=collator
    )
    trainer.train()
    return model


def test_stock_recipe_fails_on_affected_transformers_and_trains_elsewhere(tmp_path):
    model = fresh_short_whisper()
    args = trainer_args(tmp_path, gradient_checkpointing=True)
    if AFFECTED:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            train_with_trainer(model, args)
    else:
        before = copy.deepcopy(model.state_dict())
        train_with_trainer(model, args)
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_the_same_training_through_prepare_model_equals_no_checkpointing(tmp_path, mode):
    """A Trainer step with checkpointing leaves exactly the weights of one without."""
    results, untrained = {}, None
    for policy in ("full", "off"):
        torch.manual_seed(1)  # LoRA initialisation
        model = prepare_model(fresh_short_whisper(), mode=mode, checkpointing=policy, lora=LORA)
        untrained = copy.deepcopy(model.state_dict())
        # Leave the Trainer's gradient_checkpointing off: prepare_model owns checkpointing.
        results[policy] = train_with_trainer(model, trainer_args(tmp_path / policy)).state_dict()
    assert any(not torch.equal(untrained[k], v) for k, v in results["off"].items())
    unequal = [k for k, v in results["full"].items() if not torch.equal(v, results["off"][k])]
    assert not unequal, unequal[:5]


def test_doctor_flags_the_stock_recipe_and_passes_ours(tmp_path):
    stock = doctor.run(
        fresh_short_whisper(),
        tiny_batch(),
        trainer_args=trainer_args(tmp_path, gradient_checkpointing=True),
    )
    checks = {c.id: c for c in stock.checks}
    if AFFECTED:
        assert not stock.ok
        assert {c.trigger for c in stock.failed()} >= {"T1"}
        assert checks["keyword-grad"].status == "fail"
        assert "encoder_hidden_states" in checks["keyword-grad"].message
        assert "second time" in checks["parity"].message
    else:  # works, but use_reentrant was left to a default: flagged as ownership confusion
        assert stock.ok and checks["trainer"].status == "warn"
    ours = doctor.run(
        pristine("sdpa"),
        tiny_batch(),
        mode="full",
        checkpointing="full",
        trainer_args=trainer_args(tmp_path),
    )
    assert ours.ok, doctor.format_report(ours)
    assert all(c.status == "pass" for c in ours.checks), doctor.format_report(ours)


def test_seed_case_a_medium_shaped_trainer_with_patched_generate(tmp_path):
    """Seq2SeqTrainer, gradient_checkpointing=True, predict_with_generate=True and the forum's
    functools.partial(generate, language="en", use_cache=True): doctor names the real cause."""
    model, _ = short_tiny_whisper(encoder_layers=4, decoder_layers=4)  # medium is 24 + 24
    model.generate = functools.partial(model.generate, language="en", use_cache=True)
    args = trainer_args(tmp_path, gradient_checkpointing=True, predict_with_generate=True)
    report = doctor.run(model, tiny_batch(), trainer_args=args)
    checks = {c.id: c for c in report.checks}
    assert checks["generate"].status == "pass" and "does not affect" in checks["generate"].message
    if AFFECTED:
        assert checks["versions"].trigger == "T1" and checks["versions"].status == "fail"
        assert "use_reentrant" in checks["versions"].remedy
        assert checks["parity"].trigger == "T1"
    else:
        assert report.ok


def test_seed_case_b_large_v3_shaped_lora_8bit_adamw_accumulation(tmp_path):
    """LoRA r=64 on q/v, 128 mel bins, 8-bit AdamW, batch 1 x accumulation 4, checkpointing."""
    model, _ = short_tiny_whisper(num_mel_bins=128)
    lora = LoraSettings(r=64, alpha=128, dropout=0.0, targets=("q_proj", "v_proj"))
    model = prepare_model(model, mode="lora", checkpointing="full", lora=lora).train()
    assert doctor.run(model, tiny_batch(n_mels=128)).ok
    optimizer = build_optimizer(model, name="adamw8bit", lr=1e-3)
    rows = utterances(4, n_mels=128)
    lora_params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    before = {n: p.detach().clone() for n, p in lora_params.items()}
    for _step in range(2):  # peft starts B at zero: A gets gradients from the second step on
        optimizer.zero_grad(set_to_none=True)
        for row in rows:
            loss = model(**collator([row])).loss / len(rows)
            loss.backward()
        no_grad = [n for n, p in lora_params.items() if p.grad is None]
        assert not no_grad, no_grad[:3]
        optimizer.step()
    zero = [n for n, p in lora_params.items() if not p.grad.abs().sum() > 0]
    assert not zero, zero[:3]
    assert all(not torch.equal(before[n], p) for n, p in lora_params.items() if "lora_B" in n)


def test_seed_case_c_hand_enabled_checkpointing_with_the_trainer_flag_false(tmp_path):
    model = fresh_short_whisper()
    model.gradient_checkpointing_enable()
    report = doctor.run(model, tiny_batch(), trainer_args=trainer_args(tmp_path))
    check = {c.id: c for c in report.checks}["trainer"]
    assert check.trigger == "T9" and "by hand" in check.message
    assert check.status == ("fail" if AFFECTED else "warn")


DOCUMENTED_RECIPE = Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md"


def trainer_snippet() -> str:
    """docs/checkpointing.md's Seq2SeqTrainer example, as printed there (the one ```python block
    that builds a Seq2SeqTrainer)."""
    text = DOCUMENTED_RECIPE.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    found = [block for block in blocks if "Seq2SeqTrainer(" in block]
    assert len(found) == 1, f"{DOCUMENTED_RECIPE} needs exactly one Seq2SeqTrainer example"
    return found[0]


def test_the_documented_trainer_snippet_trains(tmp_path, monkeypatch):
    """The snippet runs as printed; the test fills in a tiny model and data and shortens the run
    (max_steps, batch size)."""
    monkeypatch.chdir(tmp_path)
    snippet = trainer_snippet()
    for printed, shortened in (
        ("max_steps=4000", "max_steps=2, report_to=[], use_cpu=True"),
        ("per_device_train_batch_size=16", "per_device_train_batch_size=2"),
    ):
        assert snippet.count(printed) == 1, f"the documented snippet no longer sets {printed}"
        snippet = snippet.replace(printed, shortened)
    namespace = {
        "model": fresh_short_whisper(),
        "train_dataset": utterances(),
        "data_collator": collator,
    }
    exec(snippet, namespace)  # noqa: S102 - the documented example, run as a user would
    model, trainer = namespace["model"], namespace["trainer"]
    assert trainer.state.global_step == 2
    state = checkpointing_state(model)
    assert state["enabled"] and state["reentrant"] == []
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # adapters trained from zero
