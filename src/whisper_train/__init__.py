"""whisper-train: fine-tune OpenAI Whisper on your own recordings."""

__version__ = "0.1.0"
