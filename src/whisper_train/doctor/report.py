"""What the doctor found: one `Check` per question, gathered in a `DoctorReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# The forward keyword arguments a Whisper training step takes from a batch.
MODEL_INPUTS = (
    "input_features",
    "labels",
    "decoder_input_ids",
    "attention_mask",
    "decoder_attention_mask",
    "encoder_outputs",
)
NON_REENTRANT_REMEDY = (
    "use whisper_train.prepare_model (non-reentrant), or pass "
    'gradient_checkpointing_kwargs={"use_reentrant": False}'
)


@dataclass
class Check:
    id: str  # short name, e.g. "reentrant", "parity"
    status: str  # pass | warn | fail
    message: str
    remedy: str = ""
    trigger: str = ""  # T1..T10 from docs/checkpointing.md, or "" for a general check


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return not any(check.status == "fail" for check in self.checks)

    def failed(self) -> list[Check]:
        return [check for check in self.checks if check.status == "fail"]

    def to_json(self) -> dict[str, Any]:
        keys = ("id", "status", "message", "remedy", "trigger")
        return {
            "checks": [{k: asdict(c)[k] for k in keys} for c in self.checks],
            "ok": self.ok,
        }


def format_report(report: DoctorReport) -> str:
    """One line per check: status, id, trigger, message; the remedy on the next line."""
    lines = []
    for check in report.checks:
        trigger = f" [{check.trigger}]" if check.trigger else ""
        lines.append(f"{check.status.upper():4}  {check.id}{trigger}: {check.message}")
        if check.remedy and check.status != "pass":
            lines.append(f"      remedy: {check.remedy}")
    verdict = "ok: nothing failed" if report.ok else f"{len(report.failed())} check(s) failed"
    lines.append(verdict)
    return "\n".join(lines)
