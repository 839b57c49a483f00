"""Training data, from files on disk to batches a model takes. Nothing here trains or evaluates.

examples         `Example` (one utterance) and `Skip` (a clip left out, and why)
layouts          any common layout on disk (audiofolder, manifests, Common Voice, Kaldi, HF,
                 lhotse cuts, subtitles) → a list of examples: detection, the folder layouts, `load_examples`
manifests        CSV/TSV/JSONL manifests (and the text files every layout reads) → examples
subtitles        SRT/WebVTT cues and timed segments of long recordings → windows of at most 30 s
hf_datasets      Hugging Face datasets (saved to disk, or a hub id) → examples
lhotse_cuts      lhotse CutSet manifests → examples (one a cut), read whole or as a stream
screening        held-out split, and the cheap check of every clip before training
labels           transcripts → decoder token ids (prompt prefix, timestamps, languages)
packing          several short clips into one 30-s window
features         log-mel features and the training dataset (whole clips or packed windows)
collate          a micro-batch padded for the model
augment          waveform augmentation
sampling         mixing several training sets by weight
stream_sources   what a streamed --data names (shards, patterns, hub ids), opening it, its rows
streaming        sharded data read as a stream, never whole: the stream a process iterates
stream_position  where a process stands in its stream (saved in checkpoints)
espeak           the espeak-ng engine (program or library) and the demo's voices
synth_sentences  the sentences synthesised speech says: vocabulary, its split, templates
synth            speech datasets synthesised with espeak-ng (demo, checks, tests)
source           the training data as optimizer steps, split over processes
"""
