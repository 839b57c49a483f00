"""From a fine-tuned model to what people run: export to each runtime, checked in that runtime.

export     `whisper-train export`: writes a format and checks it against the original
runtimes   running a model in transformers, faster-whisper, whisper.cpp or openai-whisper
"""
