"""Previous text as a prompt in training (`--prompt-probability`), in Whisper's own prompt form.

At inference a prompt goes before the task prefix: transformers' `generate(prompt_ids=...)`
(`WhisperTokenizer.get_prompt_ids(text)`) and long-form decoding that conditions on the text
decoded so far both feed the decoder

    <|startofprev|>  " previous text" tokens  <|startoftranscript|> [<|en|> <|transcribe|>] ...

A model fine-tuned on unprompted labels only unlearns reading that context (users report
prompts and previous-text conditioning stop working after fine-tuning). So, with probability p, a
training clip whose previous text is known gets it in exactly that form; the prompt is context,
never a target: its labels, and the prefix's, are IGNORE_INDEX (`collate.pad_labels` masks the
first `n_prefix` tokens, which here count the prompt too). distil-whisper trains this way
(`condition_on_prev_probability`, default 0.2); the default here is measured
(BENCHMARKS.md, "Prompts in training").

Where a previous text comes from (`Example.previous_text`): the preceding window of the same
recording for subtitle-cut recordings (`subtitles.pack_segments`), or a manifest's
`previous_text` / `prompt` column (`manifests.PROMPT_COLUMNS`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from whisper_train.data.labels import MAX_DECODER_TOKENS, decoder_positions
from whisper_train.errors import UserError

START_OF_PREVIOUS = "<|startofprev|>"


def max_prompt_tokens(max_target_positions: int = MAX_DECODER_TOKENS) -> int:
    """Text tokens a prompt keeps after <|startofprev|>: transformers' generate cuts previous
    text to its last `max_target_positions // 2 - 1` tokens (223 of Whisper's 448), so the
    prompt with its <|startofprev|> fills at most half the decoder."""
    return max_target_positions // 2 - 1


class Prompter:
    """Puts a clip's previous text before its label, with probability `probability`.

    The draw is a pure function of (seed, epoch, clip index), from a generator of its own:
    the same clips are prompted whether or not audio is augmented or encoder outputs cached,
    and a resumed run draws what the uninterrupted one did. The prompted label stays within
    the model's `max_target_positions` decoder positions (`labels.decoder_positions`): the
    prompt keeps its last tokens, as generate does, and as many as the label leaves room for.
    """

    def __init__(
        self,
        label_encoder,
        probability: float,
        *,
        seed: int,
        max_target_positions: int = MAX_DECODER_TOKENS,
    ):
        if not 0.0 <= probability <= 1.0:
            raise UserError(
                f"--prompt-probability {probability:g}: expected a probability in [0, 1]"
            )
        tokenizer = label_encoder.tokenizer
        self.start_of_previous_id = tokenizer.convert_tokens_to_ids(START_OF_PREVIOUS)
        if self.start_of_previous_id in (None, tokenizer.unk_token_id):
            raise UserError(
                f"the tokenizer has no {START_OF_PREVIOUS} token: prompts need a Whisper "
                "tokenizer; load the model's own processor, or drop --prompt-probability"
            )
        self.label_encoder = label_encoder
        self.probability = probability
        self.seed = seed
        self.max_target_positions = max_target_positions
        # Special and time tokens never enter a prompt (get_prompt_ids refuses them; Whisper's
        # own previous-text prompts drop time tokens): all of them follow <|endoftext|>.
        self.first_special_id = label_encoder.eot_id

    def chosen(self, index: int, epoch: int) -> bool:
        """Whether clip `index` is prompted in `epoch` (when it has a previous text)."""
        if self.probability >= 1.0:
            return True
        if self.probability <= 0.0:
            return False
        return random.Random(f"{self.seed}:{epoch}:{index}:prompt").random() < self.probability

    def prompt_ids(self, previous_text: str, room: int | None = None) -> list[int]:
        """<|startofprev|> and the last text tokens of `previous_text` (at most
        `max_prompt_tokens`, and `room` counting <|startofprev|>); [] when none fit.
        Untruncated, equal to `WhisperTokenizer.get_prompt_ids(previous_text)`."""
        text = [
            token
            for token in self.label_encoder.text_ids(previous_text)
            if token < self.first_special_id
        ]
        keep = max_prompt_tokens(self.max_target_positions)
        if room is not None:
            keep = min(keep, room - 1)
        if keep <= 0 or not text:
            return []
        return [self.start_of_previous_id, *text[-keep:]]

    def prompted(
        self,
        tokens: list[int],
        n_prefix: int,
        previous_text: str | None,
        *,
        index: int,
        epoch: int,
    ) -> tuple[list[int], int]:
        """(tokens, n_prefix) of a label (`LabelEncoder.encode`), prompted when drawn: the
        prompt goes first and counts in `n_prefix`, so the collator masks its labels."""
        if not previous_text or not previous_text.strip() or not self.chosen(index, epoch):
            return tokens, n_prefix
        room = self.max_target_positions - decoder_positions(len(tokens))
        prompt = self.prompt_ids(previous_text, room)
        return prompt + tokens, n_prefix + len(prompt)


def longest_prompted_label(label_tokens: int, probability: float, max_target_positions: int) -> int:
    """Tokens of the longest label training may build from one of `label_tokens` tokens: with
    prompts, a full prompt more, within the decoder (what a memory plan must count)."""
    if probability <= 0.0:
        return label_tokens
    longest = label_tokens + 1 + max_prompt_tokens(max_target_positions)
    return min(longest, max(label_tokens, max_target_positions + 1))


def describe_prompting(examples: Sequence, probability: float) -> str:
    """One line on what --prompt-probability will do with these training examples; a
    UserError where none has a previous text (every clip would train unprompted)."""
    with_text = sum(1 for example in examples if (example.previous_text or "").strip())
    if with_text == 0:
        raise UserError(
            f"--prompt-probability {probability:g}: no training clip has a previous text; cut "
            "long recordings with subtitles (--data-format subtitles), or add a previous_text "
            "column to the manifest, or drop --prompt-probability"
        )
    return (
        f"prompts: {with_text} of {len(examples)} training clips have a previous text, each "
        f"given it as a prompt with probability {probability:g}"
    )
