"""Dry runs on a machine without a GPU.

`python -m estimation --job.config_file X.toml --estimate.ngpu 8 --estimate.hardware h100` runs one
training step of the configured job (the trainer's own parallelize, optimizer and TrainStep,
torch.compile's own partitioning when compile is on) on fake tensors with a fake process group, and
reports per-rank memory by category, the largest local batch that fits, and predicted step time /
tokens/s / MFU at calibrated rates. `--estimate.recommend` searches the settings for a target global
batch and writes the best as a TOML. See docs/estimation.md.
"""

from titanlite.errors import ConfigError


class EstimateWarning(UserWarning):
    """A fallback an estimate took that can make it less exact. Shown by `python -m estimation` (which
    hides torch's own notices), and an error under the tests (pyproject.toml's pytest filterwarnings)."""


class DoesNotFit(ConfigError):
    """The estimate's answer that a configuration fits the GPU at no batch it may run: a result, which the
    memory check before a run acts on, unlike an estimate that failed (any other error). A ConfigError,
    so `python -m estimation` says it in one line with exit code 2. `why`: the message without its advice
    (what does not fit, by how much), for a line that goes on to say what does."""

    def __init__(self, message: str, why: str | None = None):
        super().__init__(message)
        self.why = why or message
