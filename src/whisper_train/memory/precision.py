"""Which dtype the forward pass runs in, and whether the loss needs scaling.

Weights and optimiser state stay float32 under every choice; only autocast's compute dtype
changes, so precision costs activation memory (and autocast's weight copies), never accuracy of
the master weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whisper_train.errors import UserError


@dataclass(frozen=True)
class Precision:
    """How to run the forward pass. Weights and optimiser state stay float32 in every case."""

    mixed_precision: str  # for accelerate: "no" | "bf16" | "fp16"
    dtype: torch.dtype  # the autocast compute dtype
    needs_scaler: bool  # fp16 needs loss scaling; bf16 has fp32's exponent range and does not

    @property
    def name(self) -> str:
        """The --precision name (accelerate calls fp32 "no")."""
        return "fp32" if self.mixed_precision == "no" else self.mixed_precision


_FP32 = Precision("no", torch.float32, False)
_BF16 = Precision("bf16", torch.bfloat16, False)
_FP16 = Precision("fp16", torch.float16, True)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """auto → bf16 on GPUs that support it, fp16 with loss scaling on older CUDA, fp32 elsewhere.

    An explicit bf16 is allowed on a CPU (autocast supports it; useful to check a bf16 run
    before renting a GPU); fp16 on a CPU is refused: CPU autocast has no fp16 loss scaling.
    """
    device_type = torch.device(device).type
    on_cuda = device_type == "cuda"
    bf16_ok = not on_cuda or torch.cuda.is_bf16_supported()
    if name == "auto":
        if not on_cuda:
            return _FP32
        return _BF16 if bf16_ok else _FP16
    if name == "fp32":
        return _FP32
    if name == "bf16":
        if not bf16_ok:
            raise UserError(
                "--precision bf16: this GPU has no bfloat16 support; use --precision fp16 or auto"
            )
        return _BF16
    if name == "fp16":
        if not on_cuda:
            raise UserError(
                f"--precision fp16 needs a CUDA GPU (this run is on {device_type}); "
                "use --precision bf16 or fp32"
            )
        return _FP16
    raise UserError(f"--precision {name}: expected one of auto, fp32, bf16, fp16")


__all__ = ["Precision", "resolve_precision"]
