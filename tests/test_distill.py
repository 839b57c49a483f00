"""Distillation: a student made from its teacher, trained on CE + KL against the teacher."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
from tiny_models import LORA, make_tiny_whisper, short_tiny_whisper, tiny_batch

from whisper_train.errors import UserError
from whisper_train.memory import (
    BasePreservation,
    loss_terms,
    prepare_model,
    training_loss,
    whisper_of,
)
from whisper_train.runlog import START_LINE_CHARS
from whisper_train.student import (
    check_student_fits,
    kept_decoder_layers,
    student_alignment_heads,
    student_from_teacher,
)
from whisper_train.training.distillation import data_size_advice

# -- the student made from the teacher --------------------------------------------------------


@pytest.mark.parametrize(
    ("teacher_layers", "student_layers", "kept"),
    [(6, 2, [0, 5]), (4, 3, [0, 1, 3]), (32, 4, [0, 10, 20, 31]), (32, 2, [0, 31]), (4, 1, [3])],
)
def test_the_kept_layers_are_spread_from_the_first_to_the_last(
    teacher_layers, student_layers, kept
):
    """distil-whisper's choice (create_student_model.py: linspace rounded down, last kept)."""
    assert kept_decoder_layers(teacher_layers, student_layers) == kept


@pytest.mark.parametrize("layers", [0, 5])
def test_a_student_deeper_than_the_teacher_or_empty_is_refused(layers):
    with pytest.raises(UserError, match=f"--decoder-layers {layers}: .* between 1 and 4"):
        kept_decoder_layers(4, layers)


def test_the_student_holds_the_teachers_encoder_and_chosen_decoder_layers():
    teacher, _ = make_tiny_whisper(seed=3, decoder_layers=4)
    teacher_state = {name: value.clone() for name, value in teacher.state_dict().items()}
    student = student_from_teacher(teacher, 2)
    assert student.config.decoder_layers == 2 and len(student.model.decoder.layers) == 2
    assert teacher.config.decoder_layers == 4  # the teacher is left as it was
    for name, value in student.state_dict().items():
        source = name
        if name.startswith("model.decoder.layers."):
            index, rest = name.removeprefix("model.decoder.layers.").split(".", 1)
            source = f"model.decoder.layers.{[0, 3][int(index)]}.{rest}"
        assert torch.equal(value, teacher_state[source]), name
    # the copies are the student's own: training it leaves the teacher alone
    with torch.no_grad():
        student.model.decoder.layers[1].fc1.weight.add_(1.0)
    assert torch.equal(
        teacher.model.decoder.layers[3].fc1.weight,
        teacher_state["model.decoder.layers.3.fc1.weight"],
    )
    assert not student.model.encoder.embed_positions.weight.requires_grad


def test_alignment_heads_of_kept_layers_are_renumbered_and_the_others_dropped():
    heads = [[1, 0], [2, 0], [2, 5], [3, 0], [3, 1]]  # tiny.en's, in part
    assert student_alignment_heads(heads, [0, 3]) == [[1, 0], [1, 1]]
    assert student_alignment_heads(heads, [0, 1, 3]) == [[1, 0], [2, 0], [2, 1]]
    assert student_alignment_heads([[1, 0], [2, 3]], [0, 3]) == []


def test_a_student_without_the_teachers_heads_times_words_with_the_default_ones():
    teacher, _ = make_tiny_whisper(decoder_layers=4)
    teacher.generation_config.alignment_heads = [[1, 0], [2, 3]]
    student = student_from_teacher(teacher, 2)
    assert student.generation_config.alignment_heads is None
    teacher.generation_config.alignment_heads = [[1, 0], [3, 2]]
    assert student_from_teacher(teacher, 2).generation_config.alignment_heads == [[1, 2]]


# -- the loss against the teacher ---------------------------------------------------------------

# In float64 the two sides' log-probabilities agree to ~1e-16 where they should be equal, and the
# chunked loss agrees with the naive full-vocabulary one to ~1e-15 relative; 1e-10 leaves five
# orders of magnitude for sums over the batch, while a wrong temperature, weight, direction or
# mask is off by 1e-3 or more (as in test_preserve_base.py).
FLOAT64_RTOL, FLOAT64_ATOL = 1e-10, 1e-12
TEMPERATURE, KL_WEIGHT, CE_WEIGHT = 2.0, 0.7, 0.8  # not 1: a forgotten weight is caught


def short_teacher() -> torch.nn.Module:
    """A seeded 1-second tiny Whisper of 4 decoder layers, in float64, eval (a fresh copy)."""
    return copy.deepcopy(_short_teacher())


@functools.cache
def _short_teacher() -> torch.nn.Module:
    return short_tiny_whisper(seed=5, decoder_layers=4)[0].double().eval()


def distilled(
    mode: str, *, layers: int = 2, policy: str = "off", teacher=None, ce_weight=CE_WEIGHT
) -> tuple[torch.nn.Module, BasePreservation]:
    """(a student of `layers` made from the teacher and prepared for `mode`, in training mode;
    its term against the teacher), built as the recipe builds them."""
    teacher = short_teacher() if teacher is None else teacher
    student = student_from_teacher(teacher, layers)
    student = prepare_model(student, mode=mode, checkpointing=policy, lora=LORA).train()
    term = BasePreservation.from_teacher(
        student,
        copy.deepcopy(teacher),
        weight=KL_WEIGHT,
        temperature=TEMPERATURE,
        cross_entropy_weight=ce_weight,
    )
    return student, term


def double_batch(seed: int = 0) -> dict:
    batch = tiny_batch(seed)
    batch["input_features"] = batch["input_features"].double()
    return batch


def moved(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Seeded noise on every trainable weight: the student off the teacher's weights, as some
    training steps would move it (LoRA's B matrices off zero too)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
                param.add_(0.05 * noise.to(param.dtype))
    return model


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("mode", ["freeze-encoder", "full"])
def test_a_student_equal_to_its_teacher_has_no_divergence_and_the_cross_entropys_gradients(mode):
    """A student of all the teacher's layers is the teacher: the KL term is 0 at any temperature
    and adds nothing to the gradients, which are CE_WEIGHT x the plain cross-entropy's. With a
    frozen encoder the teacher reads the student's encoder outputs; in full fine-tuning it runs
    its own encoder: both sides alike."""
    student, term = distilled(mode, layers=4)
    assert term.shares_encoder == (mode == "freeze-encoder")
    terms = loss_terms(student, double_batch(), preserve=term)
    assert terms.divergence.item() == 0.0
    terms.loss.backward()
    distilling = gradients(student)
    plain = training_loss(student, double_batch())
    (CE_WEIGHT * plain).backward()
    alone = gradients(student)
    assert distilling.keys() == alone.keys() and distilling
    for name, grad in alone.items():
        torch.testing.assert_close(
            distilling[name], grad, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL, msg=name
        )
    torch.testing.assert_close(terms.loss, CE_WEIGHT * plain.detach(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["freeze-encoder", "full", "lora"])
def test_the_loss_is_the_naive_cross_entropy_plus_the_tempered_divergence(mode):
    """CE_WEIGHT x CE + KL_WEIGHT x T^2 x KL(softmax(teacher / T) || softmax(student / T)),
    both over the full vocabulary at the label positions, the teacher's from its own whole
    forward."""
    student, term = distilled(mode)
    moved(student)
    batch = double_batch(1)
    terms = loss_terms(student, batch, preserve=term)
    keep = batch["labels"] != -100
    with torch.no_grad():
        student_logits = student(
            input_features=batch["input_features"], decoder_input_ids=batch["decoder_input_ids"]
        ).logits[keep]
        teacher = term.reference
        teacher_logits = teacher(
            input_features=batch["input_features"], decoder_input_ids=batch["decoder_input_ids"]
        ).logits[keep]
    cross_entropy = torch.nn.functional.cross_entropy(student_logits, batch["labels"][keep])
    p_teacher = torch.softmax(teacher_logits / TEMPERATURE, -1)
    divergence = (
        (
            p_teacher
            * (
                torch.log_softmax(teacher_logits / TEMPERATURE, -1)
                - torch.log_softmax(student_logits / TEMPERATURE, -1)
            )
        )
        .sum(-1)
        .mean()
    )
    expected = CE_WEIGHT * cross_entropy + KL_WEIGHT * TEMPERATURE**2 * divergence
    assert divergence > 1e-3  # the student differs: the term is not trivially 0
    for ours, theirs in ((terms.divergence, divergence), (terms.loss, expected)):
        torch.testing.assert_close(ours.detach(), theirs, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@pytest.mark.parametrize("mode", ["freeze-encoder", "full", "lora"])
def test_checkpointing_changes_memory_not_the_loss_or_the_students_gradients(mode):
    """Under the "full" policy the student's layers and both sides' loss chunks are recomputed
    in backward (non-reentrant): the same loss and gradients as without, to the bit (the same
    kernels in the same order), and the recomputation did run."""
    runs = {}
    for policy in ("off", "full"):
        student, term = distilled(mode, policy=policy)
        moved(student)
        calls = []
        # inside the checkpointed layer's forward: run again when it is recomputed
        layer = whisper_of(student).model.decoder.layers[0].fc1
        hook = layer.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        torch.manual_seed(0)
        loss = training_loss(student, double_batch(), preserve=term)
        loss.backward()
        hook.remove()
        runs[policy] = loss.detach(), gradients(student), len(calls)
    (loss_off, grads_off, calls_off), (loss_full, grads_full, calls_full) = runs.values()
    assert (calls_off, calls_full) == (1, 2)  # recomputed in backward under "full"
    assert torch.equal(loss_off, loss_full)
    assert grads_off.keys() == grads_full.keys() and grads_off
    unequal = [n for n, g in grads_full.items() if not torch.equal(g, grads_off[n])]
    assert not unequal, unequal[:5]


def test_a_packed_per_clip_batch_routes_the_teacher_as_the_student():
    """With --packing per-clip the teacher's decoder reads each clip's own encoder positions,
    masked as the student's: the teacher's decoder on the student's encoder outputs (the frozen
    encoder shared) gives the terms its own routed forward gives."""
    from test_clip_attention import packed_batch

    student, shared = distilled("freeze-encoder")
    assert shared.shares_encoder
    own = BasePreservation(
        shared.weight,
        copy.deepcopy(short_teacher()),  # its own encoder, routed by its own hooks
        False,
        None,
        shared.temperature,
        shared.cross_entropy_weight,
    )
    own.reference.requires_grad_(False)
    moved(student)
    batch = packed_batch()
    by_sharing = loss_terms(student, batch, preserve=shared)
    by_own_pass = loss_terms(student, batch, preserve=own)
    assert by_sharing.divergence > 1e-3
    for ours, theirs in zip(by_sharing, by_own_pass, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    # and the routing matters: the same clips unrouted (each against its whole window) differ
    unrouted = {k: v for k, v in batch.items() if not k.startswith("clip_")}
    unrouted["input_features"] = batch["input_features"][batch["clip_windows"]]
    assert not torch.allclose(
        loss_terms(student, unrouted, preserve=own).divergence, by_own_pass.divergence
    )


def test_a_student_with_another_vocabulary_is_refused_in_one_line():
    teacher, processor = make_tiny_whisper(decoder_layers=4)
    other, other_processor = make_tiny_whisper()
    other.config.vocab_size = 51865
    with pytest.raises(UserError, match=r"--student other: its vocabulary has 51865 tokens"):
        check_student_fits(teacher, processor, other, other_processor, "other")
    check_student_fits(teacher, processor, student_from_teacher(teacher, 2), processor, "s")


# -- the command, end to end ----------------------------------------------------------------------


def distill_argv(teacher, data, out, *flags: str) -> list[str]:
    return [
        "distill",
        f"--teacher={teacher}",
        "--decoder-layers=2",
        f"--data={data}",
        f"--output-dir={out}",
        "--batch-size=4",
        "--learning-rate=1e-3",
        "--seed=0",
        "--only-train",
        "--nonspeech=none",
        "--no-cache-encoder",  # per-clip packing (the default where it can run)
        *flags,
    ]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A saved seeded tiny Whisper of 4 decoder layers (its encoder 2)."""
    folder = tmp_path_factory.mktemp("teacher")
    model, processor = make_tiny_whisper(seed=7, decoder_layers=4)
    model.generation_config.alignment_heads = [[1, 0], [3, 2], [3, 3]]
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.mark.long
def test_a_distill_run_trains_resumes_exactly_and_refuses_another_depth(
    teacher_dir, tone_dataset, tmp_path, capsys
):
    import shutil

    import yaml
    from conftest import metric_rows
    from safetensors.torch import load_file

    from whisper_train.cli import main

    out = tmp_path / "run"
    assert (
        main(distill_argv(teacher_dir, tone_dataset, out, "--max-steps=4", "--save-steps=2")) == 0
    )
    said = capsys.readouterr().out
    assert "distillation: 0.0" in said and "(arXiv 2311.00430)" in said  # hours of audio
    assert "distilling: student decoder layers [0, 3] of 4" in said
    assert "one encoder pass for both" in said and "packing auto -> per-clip" in said
    record = yaml.safe_load((out / "whisper-train.yaml").read_text())["record"]
    assert record["model"]["teacher"] == str(teacher_dir) and record["model"]["mode"] == (
        "freeze-encoder"
    )
    assert (record["model"]["decoder_layers"], record["training"]["distill_temperature"]) == (2, 2)
    config = json.loads((out / "final" / "config.json").read_text())
    heads = json.loads((out / "final" / "generation_config.json").read_text())["alignment_heads"]
    assert config["decoder_layers"] == 2 and heads == [[1, 2], [1, 3]]
    assert "distilled from a local model folder named" in (out / "final" / "README.md").read_text()
    # the student's encoder is the teacher's, untouched; its decoder trained
    teacher, final = (
        load_file(teacher_dir / "model.safetensors"),
        load_file(out / "final" / "model.safetensors"),
    )
    encoder = [n for n in final if n.startswith("model.encoder.")]
    assert encoder and all(torch.equal(final[n], teacher[n]) for n in encoder)
    assert not torch.equal(
        final["model.decoder.layers.1.fc1.weight"], teacher["model.decoder.layers.3.fc1.weight"]
    )

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for name in ("checkpoint-2", "whisper-train.yaml", "metrics.jsonl"):
        source = out / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, resumed / name)
    argv = distill_argv(teacher_dir, tone_dataset, resumed, "--max-steps=4", "--save-steps=2")
    assert main([*argv, "--resume=latest"]) == 0
    assert metric_rows(resumed) == metric_rows(out)
    again = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(again[n], final[n]) for n in final)

    capsys.readouterr()
    argv = [a if a != "--decoder-layers=2" else "--decoder-layers=3" for a in argv]
    assert main([*argv, "--max-steps=6", "--resume=latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--decoder-layers" in err, err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--data=x", "--decoder-layers=2"], "distill needs --teacher MODEL"),
        (["--teacher=tiny.en", "--data=x"], "distill needs the student: --decoder-layers N"),
        (
            ["--teacher=tiny.en", "--data=x", "--decoder-layers=2", "--student=base"],
            "--student base with --decoder-layers 2",
        ),
        (
            ["--teacher=tiny.en", "--data=x", "--decoder-layers=2", "--preserve-base=1"],
            "--preserve-base with --teacher tiny.en",
        ),
        (
            ["--teacher=tiny.en", "--data=x", "--decoder-layers=2", "--distill-temperature=0"],
            "--distill-temperature 0: expected a finite temperature above 0",
        ),
        (["--teacher=tiny.en", "--data=x", "--decoder-layers=0"], "--decoder-layers"),
        (  # the cached outputs of the student's own encoder would stand for the teacher's
            ["--teacher=tiny.en", "--data=x", "--student=base", "--cache-encoder"],
            "add --no-cache-encoder",
        ),
    ],
)
def test_what_cannot_distil_is_refused_in_one_line(argv, said, capsys, tmp_path):
    from whisper_train.cli import main

    assert main(["distill", f"--output-dir={tmp_path / 'out'}", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and said in err, err
    assert not (tmp_path / "out").exists()


def test_train_refuses_decoder_layers_without_a_teacher(capsys, tmp_path):
    from whisper_train.cli import main

    assert main(["train", "--data=x", "--decoder-layers=2", f"--output-dir={tmp_path}/o"]) == 2
    assert "--decoder-layers 2 makes a student from a teacher: add --teacher" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("hours", "said"),
    [
        (None, "streamed data (hours unknown)"),
        (0.5, "0.5 h of audio, under the ~1,000 h a 2-layer student needs"),
        (5000, "5,000 h of audio, at or above the ~1,000 h"),
    ],
)
def test_the_advice_places_the_hours_against_the_published_rule(hours, said):
    line, detail = data_size_advice(hours, decoder_layers=2, teacher_layers=32)
    assert said in line and "arXiv 2311.00430" in line and len(line) <= START_LINE_CHARS
    assert "kotoba-whisper" in detail and "2 of 32" in detail


# -- the student in every runtime ---------------------------------------------------------------


def test_a_student_exports_to_every_runtime_and_each_reads_its_shallower_decoder(tmp_path):
    """A decoder of 2 layers under an encoder of 4 (a student of tiny.en's shape): every
    format's file says so, every runtime loads and decodes it, and whisper-train reads each
    back with its 2 layers."""
    import whisper
    from faster_whisper import WhisperModel
    from pywhispercpp.model import Model

    from whisper_train.deploy.export import save_export
    from whisper_train.formats import ggml
    from whisper_train.formats import openai as openai_whisper
    from whisper_train.models import load_model

    teacher, processor = make_tiny_whisper(
        seed=2, encoder_layers=4, decoder_layers=4, encoder_ffn_dim=256, decoder_ffn_dim=256
    )
    student = student_from_teacher(teacher, 2).eval()
    audio = np.zeros(16000, dtype=np.float32)
    for format in ("hf", "ct2", "ggml", "openai"):
        quantization = "float32" if format in ("hf", "ct2") else "float16"
        save_export(student, processor, tmp_path / format, format=format, quantization=quantization)
    fw = WhisperModel(str(tmp_path / "ct2"), device="cpu")
    assert fw.model.n_mels == 80
    list(fw.transcribe(audio, without_timestamps=True, max_new_tokens=4, beam_size=1)[0])
    cpp = Model(str(tmp_path / "ggml" / ggml.GGML_MODEL_FILE), redirect_whispercpp_logs_to=None)
    cpp.transcribe(audio, language="en", max_tokens=4, no_timestamps=True, single_segment=True)
    del cpp
    ow = whisper.load_model(str(tmp_path / "openai" / openai_whisper.OPENAI_MODEL_FILE), "cpu")
    assert (ow.dims.n_audio_layer, ow.dims.n_text_layer) == (4, 2)
    mel = whisper.log_mel_spectrogram(whisper.pad_or_trim(torch.from_numpy(audio)))
    whisper.decode(ow, mel, whisper.DecodingOptions(language="en", fp16=False, sample_len=4))
    for format in ("hf", "ct2", "ggml", "openai"):
        back, _ = load_model(str(tmp_path / format))
        assert (back.config.encoder_layers, back.config.decoder_layers) == (4, 2), format


@pytest.mark.speech
@pytest.mark.long
@pytest.mark.parametrize(
    ("format", "quantization"),
    [("hf", "float32"), ("ct2", "float32"), ("ct2", "float16"), ("openai", "float16")],
)
def test_a_student_of_tiny_en_passes_the_export_check(format, quantization, tmp_path):
    """The real tiny.en's student (decoder layers 0 and 3 of 4): each export's own check (the
    source's transcripts scored by the runtime) passes, as for tiny.en itself."""
    from whisper_train.deploy.export import save_export
    from whisper_train.deploy.parity import check_clips, check_export, score_source
    from whisper_train.models import load_model

    teacher, processor = load_model("tiny.en")
    student = student_from_teacher(teacher, 2).eval()
    source = score_source(student, processor, check_clips(None, n_clips=4), None)
    save_export(student, processor, tmp_path, format=format, quantization=quantization)
    check = check_export(source, format, tmp_path, quantization)
    assert check.passed, check.summary()
