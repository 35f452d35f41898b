"""Lightning + thinwire: a run of two epochs checkpointed after the first by Lightning's
ModelCheckpoint, resumed from that file, must end on the same weights on every rank.

    torchrun --nproc-per-node 2 lightning_resume.py ddp OUT      # or: python ... ddp_spawn OUT

``THINWIRE_TEST_COMPRESSORS=dgc,powersgd`` runs only those (default: all of ``COMPRESSORS``).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from shared import COMPRESSORS, arguments, dataset, model, weights
from torch.nn import functional as F
from torch.utils.data import DataLoader

from thinwire.integrations.lightning import ThinwireCallback


class Digits(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Weights(L.Callback):
    """Writes each rank's final weights and engine step (ddp_spawn returns none)."""

    def __init__(self, path: Path, thinwire: ThinwireCallback) -> None:
        self.path, self.thinwire = path, thinwire

    def on_train_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
        state = {"weights": weights(module), "step": self.thinwire.engine.step}
        torch.save(state, self.path.with_name(f"{self.path.name}-rank{trainer.global_rank}.pt"))


def fit(strategy: str, out: Path, name: str, tag: str, ckpt: str | None) -> None:
    thinwire = ThinwireCallback(name, **COMPRESSORS[name])
    saver = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=out / f"{name}-ckpt", every_n_epochs=1, save_top_k=-1, filename="{epoch}"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2,
        callbacks=[thinwire, saver, Weights(out / f"{name}-{tag}", thinwire)],
        logger=L.pytorch.loggers.CSVLogger(out, name=f"{name}-{tag}", version=0),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader(dataset(), batch_size=16)  # 3 steps an epoch on each of 2 ranks
    trainer.fit(Digits(), loader, ckpt_path=ckpt)


def main() -> None:
    strategy, out = arguments()
    out = Path(out)
    summary = {}
    chosen = os.environ.get("THINWIRE_TEST_COMPRESSORS")
    for name in chosen.split(",") if chosen else COMPRESSORS:
        fit(strategy, out, name, "straight", None)
        fit(strategy, out, name, "resumed", str(out / f"{name}-ckpt" / "epoch=0.ckpt"))
        if dist.is_initialized():  # torchrun: every rank's files are written
            dist.barrier()
        runs = [
            [torch.load(out / f"{name}-{tag}-rank{rank}.pt") for tag in ("straight", "resumed")]
            for rank in range(2)
        ]
        with open(out / f"{name}-straight" / "version_0" / "metrics.csv") as f:
            ratios = [float(row["thinwire/compression_ratio"]) for row in csv.DictReader(f)
                      if row.get("thinwire/compression_ratio")]  # fmt: skip
        summary[name] = {
            "same": [all(map(torch.equal, a["weights"], b["weights"])) for a, b in runs],
            "steps": [[a["step"], b["step"]] for a, b in runs],
            "ratios": ratios,
        }
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
