"""From a fine-tuned model to what people run: export to each runtime, checked in that runtime.

export     `whisper-train export`: merges a LoRA adapter, writes a format, then checks it
parity     the check that an export transcribes as its source: the export's runtime scores the
           source's transcripts (`check_export`, `ParityCheck`)

What differs between formats (writers, readers, runtimes) is each format's row of
`formats.registry`.
"""
