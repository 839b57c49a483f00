"""Compute a frozen encoder's outputs once per clip and reuse them every epoch.

With the encoder frozen and the audio not augmented, the encoder maps each clip to the same
(1500, d_model) tensor every epoch, and it is ~84% of Whisper's training FLOPs
(`../shared/notes/anchors.md`). Caching it turns each later epoch into decoder-only work.

Storage: a CPU tensor, or a memory-mapped .npy file under the output folder when the cache would
be larger than `max_in_memory_bytes` (whisper-small: 1500 x 768 x 2 bytes = 2.3 MB a clip).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

log = logging.getLogger(__name__)


class EncoderCache:
    """Encoder hidden states indexed by dataset position: `lookup(indices)` → (batch, 1500, d)."""

    def __init__(self, states: torch.Tensor | np.memmap, filled: torch.Tensor):
        self.states = states
        self.filled = filled  # bool per example: False for clips that could not be decoded

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        encoder: torch.nn.Module,
        loader: DataLoader,
        *,
        n_examples: int,
        device: torch.device,
        dtype: torch.dtype,
        autocast_dtype: torch.dtype | None = None,
        spill_dir: Path | None = None,
        max_in_memory_bytes: int = 4 * 1024**3,
        progress=None,
    ) -> EncoderCache:
        """Run `encoder` over every batch of `loader` (batches with `input_features`)."""
        encoder.eval()
        states = None
        filled = torch.zeros(n_examples, dtype=torch.bool)
        for batch in loader:
            if progress is not None:
                progress.update(len(batch["skipped"]) + batch["size"])
            if not batch["size"]:
                continue
            features = batch["input_features"].to(device)
            with torch.autocast(
                device.type,
                dtype=autocast_dtype or torch.float32,
                enabled=autocast_dtype is not None,
            ):
                hidden = encoder(features).last_hidden_state.to(dtype).cpu()
            if states is None:
                states = cls._allocate(
                    n_examples, hidden.shape[1:], dtype, spill_dir, max_in_memory_bytes
                )
            index = batch["indices"]
            if isinstance(states, np.memmap):
                states[index.numpy()] = hidden.float().numpy().astype(states.dtype)
            else:
                states[index] = hidden
            filled[index] = True
        if states is None:
            raise RuntimeError("no clip could be encoded")  # screened earlier: unreachable by users
        return cls(states, filled)

    @staticmethod
    def _allocate(n: int, shape: torch.Size, dtype: torch.dtype, spill_dir, max_bytes: int):
        n_bytes = n * int(np.prod(shape)) * torch.finfo(dtype).bits // 8
        if n_bytes <= max_bytes or spill_dir is None:
            return torch.zeros((n, *shape), dtype=dtype)
        # numpy has no bfloat16: spill as float16 (encoder outputs are LayerNorm-ed, |x| << 65504).
        path = Path(spill_dir) / "encoder-cache.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        log.info("encoder cache: %.1f GB memory-mapped at %s", n_bytes / 1e9, path)
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(n, *shape))

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        if isinstance(self.states, np.memmap):
            return torch.from_numpy(np.asarray(self.states[indices.numpy()]))
        return self.states[indices]
