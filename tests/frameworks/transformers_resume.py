"""The Hugging Face Trainer + thinwire: six steps with a checkpoint every three, then a
new Trainer resumed from the step-3 checkpoint; each rank writes whether its weights ended
the same, the engine's steps and the logged compression ratios.

    torchrun --nproc-per-node 2 transformers_resume.py OUT
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from shared import COMPRESSORS, arguments, dataset, model, weights
from torch import nn
from torch.nn import functional as F
from transformers import Trainer, TrainingArguments

from thinwire.integrations.transformers import register


class Digits(nn.Module):
    """The digits perceptron as the Trainer calls it: keyword inputs, a loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Examples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"x": x, "labels": y}


def train(name: str, out: Path, resume: str | None) -> tuple:
    args = TrainingArguments(
        output_dir=str(out / name), per_device_train_batch_size=8, max_steps=6,
        save_strategy="steps", save_steps=3, logging_steps=1, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", use_cpu=True, ddp_backend="gloo", report_to="none",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=Digits(), args=args, train_dataset=Examples())
    callback = register(trainer, name, **COMPRESSORS[name])
    trainer.train(resume_from_checkpoint=resume)
    ratios = [e["thinwire/compression_ratio"] for e in trainer.state.log_history
              if "thinwire/compression_ratio" in e]  # fmt: skip
    return weights(trainer.model), callback.engine.step, ratios


def main() -> None:
    (out,) = arguments()
    out = Path(out)
    summary = {}
    for name in COMPRESSORS:
        straight, straight_steps, ratios = train(name, out, None)
        resumed, resumed_steps, _ = train(name, out, str(out / name / "checkpoint-3"))
        summary[name] = {
            "same": all(map(torch.equal, straight, resumed)),
            "steps": [straight_steps, resumed_steps],
            "ratios": ratios,
        }
    rank = torch.distributed.get_rank()
    (out / f"summary-rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
