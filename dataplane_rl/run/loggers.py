"""Metric sinks besides metrics.jsonl: TensorBoard (on by default) and Weights & Biases (offline, opt-in).

TensorBoard through `torch.utils.tensorboard.SummaryWriter` and the `tensorboard` package: the
well-kept writer every trainer in this field uses, and the event format `tensorboard --logdir runs/`
reads; writing event files by hand would re-implement its record framing and CRCs.
"""

from __future__ import annotations

import numbers
from pathlib import Path

from dataplane_rl.errors import ConfigError


def _scalars(metrics: dict) -> dict[str, float]:
    # booleans (data_plane/enabled) are scalars too; the step is the x axis, not a series
    return {k: float(v) for k, v in metrics.items() if k != "step" and isinstance(v, numbers.Real)}


class MetricLoggers:
    """Every metrics dict logged to each enabled sink at its step. close() flushes; safe to call twice."""

    def __init__(self, logger_cfg, run_dir: str | Path, config: dict | None = None) -> None:
        self.tb = None
        self.wandb_run = None
        run_dir = Path(run_dir)
        if logger_cfg.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if logger_cfg.wandb_enabled:
            try:
                import wandb
            except ImportError:  # the config refuses this first; here for a package removed since
                raise ConfigError("logger.wandb_enabled=true needs the wandb package: pip install wandb "
                                  "(or set logger.wandb_enabled=false)") from None
            # offline: no account or network needed; `wandb sync RUN_DIR/wandb/offline-run-*` uploads later
            self.wandb_run = wandb.init(project=logger_cfg.wandb_project, dir=str(run_dir), mode="offline",
                                        config=config or {}, reinit=True)

    def log(self, metrics: dict, step: int) -> None:
        values = _scalars(metrics)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, global_step=step)
            self.tb.flush()  # a crash or Ctrl-C must not lose the steps already logged
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
