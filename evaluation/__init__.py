"""reelflow on the benchmarks people use: an lmms-eval model backend (evaluation.lmms_model), the
speed it reports beside every answer (evaluation.speed), a local video task (evaluation.toy_task)
and the `+experiment=lmms_eval` job that compares methods on a task (evaluation.job)."""

import models  # noqa: F401  (its torchvision check runs before lmms-eval's model imports need transformers)
