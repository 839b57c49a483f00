"""From audio to timed text: how whisper-train decodes, and `whisper-train transcribe`.

decoding          generation that cannot loop: the language of each clip, greedy (or beam
                  search), then the temperature fallback for an output that repeats itself or
                  that the model did not believe (`DecodingOptions`, `generate_decoded`)
longform          transformers' sequential decoding of recordings longer than 30 s, window by
                  window with timestamps (what `evaluate` scores and `transcribe` runs)
word_timestamps   words timed from token times (transformers' DTW over the alignment heads),
                  and finding and saving a fine-tuned model's alignment heads
transcripts       a transcript and its txt, SRT, WebVTT and JSON files
backends          one runner per runtime: transformers, faster-whisper, whisper.cpp,
                  openai-whisper (each format's row in `formats.registry` names its own)
transcribe        `transcribe_paths`: files, folders and manifests → transcripts, each model run
                  by its own format's backend

Every module but `transcribe` sits low in the layers (docs/architecture.md): evaluation,
training's configuration and the format registry decode with them. `transcribe` sits at the
top, beside the command line, since it loads any `--model` (models) and reads manifests.
"""
