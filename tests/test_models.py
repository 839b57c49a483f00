"""`--model` resolution: alias, run folder, HF folder, CTranslate2 folder, hub id."""

from __future__ import annotations

import json
import re

import pytest
import torch

from whisper_train.errors import UserError
from whisper_train.models import is_multilingual, load_model, resolve_alias


def test_tiny_en_alias_resolves_to_the_packaged_model(tiny_en_ct2_dir):
    assert resolve_alias("tiny.en") == str(tiny_en_ct2_dir)
    model, processor = load_model("tiny.en")
    assert model.config.d_model == 384 and not is_multilingual(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert processor.tokenizer.convert_tokens_to_ids("<|notimestamps|>") == 50362


def test_run_folder_resolves_to_its_final_model(tmp_path, tiny_whisper_dir):
    import shutil

    shutil.copytree(tiny_whisper_dir, tmp_path / "run" / "final")
    model, _ = load_model(str(tmp_path / "run"))
    reference, _ = load_model(str(tiny_whisper_dir))
    assert torch.equal(model.proj_out.weight, reference.proj_out.weight)


def hub_answers(monkeypatch, error: Exception | None) -> list[str]:
    """Make every download transformers asks huggingface_hub for raise `error` (what the hub
    library raises when the hub is down or has no such repository); returns the ids asked for."""
    import transformers.utils.hub

    asked: list[str] = []

    def download(repo_id, *args, **kwargs):
        asked.append(repo_id)
        raise error

    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", download)
    monkeypatch.setattr(transformers.utils.hub, "snapshot_download", download)
    return asked


def http_error(kind, status: int):
    from huggingface_hub.utils import httpx

    request = httpx.Request("HEAD", "https://huggingface.co/runs/nope/resolve/main/config.json")
    return kind(f"{status} Client Error", response=httpx.Response(status, request=request))


def test_a_missing_folder_that_could_be_a_hub_id_says_both_when_the_hub_is_unreachable(
    monkeypatch, tmp_path
):
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # What huggingface_hub raises when a look-up gets no answer and nothing is cached.
    unreachable = LocalEntryNotFoundError("An error happened while trying to locate the file")
    unreachable.__cause__ = ConnectionError("[Errno -2] Name or service not known")
    asked = hub_answers(monkeypatch, unreachable)

    with pytest.raises(UserError) as caught:
        load_model("runs/nope")
    message = str(caught.value)
    assert message.startswith(f"--model runs/nope: no such folder (looked in {tmp_path})")
    assert "tried as a hub id, the model hub could not be reached;" in message
    assert "\n" not in message and "HF_HUB_OFFLINE" not in message
    assert set(asked) == {"runs/nope"}


def test_a_missing_folder_that_could_be_a_hub_id_says_both_when_the_hub_has_no_such_model(
    monkeypatch,
):
    from huggingface_hub.errors import RepositoryNotFoundError

    hub_answers(monkeypatch, http_error(RepositoryNotFoundError, 404))
    with pytest.raises(UserError, match=r"^--model runs/nope: no such folder .*") as caught:
        load_model("runs/nope")
    assert "tried as a hub id, the model hub has no model runs/nope;" in str(caught.value)


def test_hub_id_in_offline_mode_names_the_setting():
    """conftest sets HF_HUB_OFFLINE, as a user's sandbox might: the real call, no fakes."""
    with pytest.raises(UserError) as caught:
        load_model("openai/whisper-nonexistent-xyz")
    message = str(caught.value)
    assert message.startswith("--model openai/whisper-nonexistent-xyz: no such folder")
    assert "could not be reached (HF_HUB_OFFLINE is set)" in message


@pytest.mark.parametrize(
    "spec", ["./runs/nope", "/abs/path/nope", "../nope", "a/b/c", "model.bin", "~/nope-xyz"]
)
def test_a_missing_path_that_cannot_be_a_hub_id_is_only_a_missing_folder(monkeypatch, spec):
    asked = hub_answers(monkeypatch, AssertionError("the hub must not be asked"))
    with pytest.raises(UserError, match=rf"^--model {re.escape(spec)}: no such folder") as caught:
        load_model(spec)
    assert "hub id," not in str(caught.value) and asked == []


def test_a_hub_id_still_loads_from_the_hub(monkeypatch, tmp_path, tiny_whisper_dir):
    """A real user's `--model openai/whisper-small`: served here from a huggingface_hub cache
    (the layout a download leaves), through the same transformers calls as a download."""
    import shutil

    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--openai--whisper-small"
    shutil.copytree(tiny_whisper_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    model, processor = load_model("openai/whisper-small")
    reference, _ = load_model(str(tiny_whisper_dir))
    assert torch.equal(model.proj_out.weight, reference.proj_out.weight)
    assert processor.tokenizer.pad_token == "<|endoftext|>"


def test_non_whisper_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(UserError, match="not a Whisper model config"):
        load_model(str(tmp_path))


# -- damaged model folders: one line naming the file, exit 2, for every command -------------


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _drop_shape_keys(file):
    config = json.loads(file.read_text())
    del config["d_model"], config["encoder_layers"]
    file.write_text(json.dumps(config))


# (what is done to the folder, the file the error must name, what it must say about it)
DAMAGES = {
    "truncated weights": ("model.safetensors", _truncate, "is truncated"),
    "config not JSON": ("config.json", lambda f: f.write_text('{"model_type": '), "valid JSON"),
    "config lacks keys": ("config.json", _drop_shape_keys, "lacks d_model, encoder_layers"),
    "no weights file": ("model.safetensors", lambda f: f.unlink(), "no weights file"),
}


def _command_argv(command, model, tmp_path, tone_dataset):
    if command == "train":
        return ["train", "--data", str(tone_dataset), "--model", str(model), "--only-train"] + [
            "--output-dir",
            str(tmp_path / "run"),
            "--max-steps=1",
        ]
    if command == "evaluate":
        return ["evaluate", "--model", str(model), "--data", str(tone_dataset)]
    return ["export", "--model", str(model), "--output", str(tmp_path / "exported"), "--no-check"]


@pytest.mark.parametrize("damage", list(DAMAGES))
@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_a_damaged_model_folder_is_one_line_naming_the_file_and_exit_2(
    command, damage, tmp_path, tiny_whisper_dir, tone_dataset, capsys
):
    import shutil

    from whisper_train.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, folder)
    name, damage_it, says = DAMAGES[damage]
    damage_it(folder / name)
    code = main(_command_argv(command, folder, tmp_path, tone_dataset))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err
    target = folder if name == "model.safetensors" and "no weights" in says else folder / name
    assert str(target) in line and says in line, line
    assert "copy" in line  # the remedy
    assert not (tmp_path / "exported").exists() and not (tmp_path / "run" / "final").exists()


class _RunsCode:
    """Pickles as a call of os.system: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pytorch_model_bin_with_a_pickled_object_that_runs_code_is_refused(
    tmp_path, tiny_whisper_dir
):
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, folder)
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "the-pickle-ran"
    torch.save({**weights, "extra": _RunsCode(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"could not load .*UnpicklingError") as caught:
        load_model(str(folder))
    assert "\n" not in str(caught.value)
    assert not marker.exists()
