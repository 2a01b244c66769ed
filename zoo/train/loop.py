"""The training loop every recipe shares, and the contract a recipe fills in (`Recipe`).

    result = train(recipe, LoopConfig(steps=3000, lr=5e-4), progress=True)

The loop knows nothing of videos, models or losses: it resolves the device, seeds torch, asks the
recipe to build what it trains, reads the recipe's batches through a DataLoader (worker processes
render them while the step runs), and each step adds up the recipe's named losses with the
recipe's weights, clips the gradient, and steps AdamW on a warmup-then-cosine schedule, under bf16
autocast or in fp32. It logs the running losses every `log_every` steps, runs the recipe's quick
check every `eval_every`, stops early when `max_minutes` is spent, and at the end has the recipe
save its checkpoint and evaluate it, and writes training.json beside it.

Every `checkpoint_every` steps, and when Ctrl-C stops it, the loop writes its whole state to
`<out>/training-state.pt` (the trained parameters, the optimizer and schedule, torch's random
state, the history and the settings). `resume=true` loads it and goes on: batches come from the
recipe from the next step on, so an interrupted and resumed run ends with the weights an
uninterrupted one would have. A finished run removes the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from zoo.train.config import LoopConfig
from zoo.train.device import loader_workers_for, resolve_device

log = logging.getLogger("reelflow.train")


class Recipe:
    """What a recipe gives the loop. The loop calls, in this order: `build` once (after seeding
    torch), `batches` once, `loss` every step, `evaluate(final=False)` every `eval_every` steps,
    then `save` and `evaluate(final=True)` once each, and `record` for training.json.

    A recipe that trains a small part of a bigger frozen model (a draft head on a target's hidden
    states) builds both, returns only the part's parameters from `build`, and runs the frozen model
    inside `loss` (under no_grad) or inside its batches' workers."""

    name: str = "recipe"           # what is trained: the progress bar's and the log's label

    def build(self, device: torch.device) -> list[torch.nn.Parameter]:
        """Makes (or loads) everything the steps need, on `device`, in training mode; returns the
        parameters the optimizer updates and whose gradient norm is clipped."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the log about what was built (after `build`)."""
        return self.name

    @property
    def weights(self) -> dict[str, float]:
        """How `loss`'s named terms add up to what is minimised; a name missing here weighs 0."""
        raise NotImplementedError

    def batches(self, steps: int, seed: int, start: int = 0) -> torch.utils.data.IterableDataset:
        """The endless training batches (dicts, lists or tuples of tensors; the loop moves them to
        the device) from step `start` on: the same batches an uninterrupted run trains on at those
        steps. `steps`: the planned step count, for a curriculum; `seed`: the run's. Each
        DataLoader worker iterates its own copy: draw per worker (torch.utils.data.get_worker_info)."""
        raise NotImplementedError

    def loss(self, batch) -> dict[str, torch.Tensor]:
        """The step's named loss terms, scalars, unweighted; the first is the headline (progress
        bar, check rows). Runs under the loop's autocast."""
        raise NotImplementedError

    def evaluate(self, final: bool) -> dict:
        """The check's figures for training.json: `final=False` a quick look during training (its
        figures go into that step's history row), `final=True` the check of what `save` wrote.
        Must leave the model as it found it (mode, attention implementation)."""
        return {}

    def default_out(self) -> Path:
        """Where the checkpoint goes when the loop's `out` is unset (asked before `build`)."""
        raise NotImplementedError

    def save(self, out_dir: Path) -> None:
        """Writes the trained model to `out_dir` (the loop then writes training.json there)."""
        raise NotImplementedError

    def record(self) -> dict:
        """The recipe's settings and facts for training.json (after `save`)."""
        return {}

    def card(self, result: dict) -> str | None:
        """A README.md for the saved model (what it was trained on, its checks, the command), or None."""
        return None


STATE_FILE = "training-state.pt"


def train(recipe: Recipe, config: LoopConfig, progress: bool | None = None) -> dict:
    """Trains `recipe` as `config` says (see the module doc); returns what training.json holds.
    `progress`: False hides the progress bar (None: tqdm's default)."""
    from tqdm import tqdm

    steps = config.steps
    device = resolve_device(config.device)
    loader_workers = loader_workers_for(device, config.loader_workers)
    out_dir = Path(config.out) if config.out else recipe.default_out()
    _refuse_replacing(out_dir, config)            # before anything is built: that may take long
    torch.manual_seed(config.seed)
    params = recipe.build(device)
    state_path = out_dir / STATE_FILE
    settings = _settings(recipe, config)
    saved = _load_state(state_path, settings) if config.resume else None
    if saved is None and state_path.exists():
        log.warning("%s holds an unfinished run's state; starting over (train.resume=true goes on from it)", state_path)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    log.info("training %s: %s, %d steps, on %s%s with %d loader workers", recipe.name, recipe.describe(), steps,
             device, f" ({device_name})" if device_name else "", loader_workers)
    weights = recipe.weights
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / config.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    history: list[dict] = []
    running: dict[str, float] = {}
    start, spent_before = 0, 0.0
    if saved is not None:
        with torch.no_grad():
            for p, value in zip(params, saved["params"]):
                p.copy_(value)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["schedule"])
        history, running = saved["history"], saved["running"]
        start, spent_before = saved["step"], saved["train_s"]
        log.info("resuming from step %d of %d (%s)", start, steps, state_path)
    loader = torch.utils.data.DataLoader(recipe.batches(steps, config.seed, start), batch_size=None,
                                         num_workers=loader_workers, prefetch_factor=4 if loader_workers else None,
                                         persistent_workers=False, pin_memory=device.type == "cuda")
    batches = iter(loader)   # before the random state is put back: making it draws from torch's generator
    if saved is not None:
        _set_rng(saved["rng"])
    t0 = time.perf_counter() - spent_before
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=f"train {recipe.name}",
               disable=progress is False, mininterval=5)
    steps_done = start

    def row(step: int) -> dict:
        return {"step": step, "s": round(time.perf_counter() - t0, 1)} | {k: round(v, 4) for k, v in running.items()}

    def save_state() -> None:
        _save_state(state_path, {"step": steps_done, "params": [p.detach().cpu() for p in params],
                                 "optimizer": opt.state_dict(), "schedule": sched.state_dict(),
                                 "history": history, "running": running, "train_s": time.perf_counter() - t0,
                                 "rng": _get_rng(), "settings": settings})

    try:
        for step in bar:
            batch = to_device(next(batches), device)
            # bf16 autocast: matmuls in bf16, weights and optimizer in fp32, for speed where the
            # hardware has bf16 units (AVX512-BF16 CPUs, GPUs)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.precision == "bf16"):
                losses = recipe.loss(batch)
            sum(weights.get(k, 0.0) * v for k, v in losses.items()).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            for k, v in losses.items():
                running[k] = v.item() if k not in running else 0.95 * running[k] + 0.05 * v.item()
            headline = next(iter(running))
            rate = (step + 1 - start) / max(1e-9, time.perf_counter() - t0 - spent_before)
            bar.set_postfix({headline: f"{running[headline]:.3f}", "steps/s": f"{rate:.2f}"}, refresh=False)
            if (step + 1) % config.log_every == 0 or step + 1 == steps:
                history.append(row(step + 1))
                log.info("step %d %s (%.0f s)", step + 1, " ".join(f"{k} {v:.4f}" for k, v in running.items()),
                         time.perf_counter() - t0)
            if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < steps:
                found = recipe.evaluate(final=False)
                if not history or history[-1]["step"] != step + 1:
                    history.append({"step": step + 1, headline: round(running[headline], 4),
                                    "s": round(time.perf_counter() - t0, 1)})
                history[-1].update(found)
                if found:
                    log.info("step %d check: %s", step + 1, " ".join(f"{k} {v}" for k, v in found.items()))
            steps_done = step + 1
            if config.checkpoint_every and steps_done % config.checkpoint_every == 0 and steps_done < steps:
                save_state()
            if config.max_minutes is not None and time.perf_counter() - t0 > 60 * config.max_minutes \
                    and steps_done < steps:
                log.warning("max_minutes=%g reached after %d of %d steps: saving what is there", config.max_minutes,
                            steps_done, steps)
                if not history or history[-1]["step"] != steps_done:
                    history.append(row(steps_done))
                break
    except KeyboardInterrupt:
        bar.close()
        save_state()
        log.warning("stopped at step %d of %d; the state is in %s: add train.resume=true to the same command to "
                    "go on", steps_done, steps, state_path)
        raise
    bar.close()
    recipe.save(out_dir)
    final = recipe.evaluate(final=True)
    result = recipe.record() | {
        "steps": steps_done, "steps_planned": steps, "max_minutes": config.max_minutes, "lr": config.lr,
        "precision": config.precision, "device": str(device), "device_name": device_name,
        "loader_workers": loader_workers, "train_s": round(time.perf_counter() - t0, 1),
        "resumed_at": start if saved is not None else None, "history": history} | final
    (out_dir / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    card = recipe.card(result)
    if card:
        (out_dir / "README.md").write_text(card)
    state_path.unlink(missing_ok=True)
    log.info("%s: saved to %s", recipe.name, out_dir)
    return result


def _refuse_replacing(out_dir: Path, config: LoopConfig) -> None:
    """A finished model in `out_dir` (its training.json) is replaced only when asked: a try of a
    recipe must not silently overwrite hours of training, or a model the repository ships."""
    from graph.spec import ConfigError

    if (out_dir / "training.json").exists() and not (config.overwrite or config.resume):
        shown = out_dir.resolve().relative_to(Path.cwd()) if out_dir.resolve().is_relative_to(Path.cwd()) else out_dir
        where = f"train.out={shown}" if config.out else f"train.out (unset, so {shown})"
        raise ConfigError([f"{where}: holds a trained model (training.json); training would replace it. "
                           "Fix: another train.out, or train.overwrite=true to replace it"])


def _settings(recipe: Recipe, config: LoopConfig) -> dict:
    """What must not change between a run and its resumption: the loop's and the recipe's settings
    (bar the ones that only say how to run: resume, where to log, the time limit)."""
    loop_keys = {k: v for k, v in vars(config).items() if k not in ("resume", "overwrite", "log_every", "max_minutes",
                                                                    "loader_workers", "checkpoint_every")}
    return json.loads(json.dumps(loop_keys | recipe.record(), default=str))


def _save_state(path: Path, state: dict) -> None:
    """Written whole or not at all: a Ctrl-C during the write leaves the previous state."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_state(path: Path, settings: dict) -> dict | None:
    from graph.spec import ConfigError

    if not path.exists():
        raise ConfigError(f"train.resume=true: no saved training state at {path} (a run saves one every "
                          f"checkpoint_every steps and on Ctrl-C; a finished run removes it)")
    saved = torch.load(path, weights_only=False)
    changed = sorted(k for k in set(settings) | set(saved["settings"]) if settings.get(k) != saved["settings"].get(k))
    if changed:
        raise ConfigError(f"train.resume=true: {path} was saved with other settings: "
                          + ", ".join(f"{k}={saved['settings'].get(k)!r} (now {settings.get(k)!r})" for k in changed))
    return saved


def _get_rng() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def to_device(x, device: torch.device):
    """`x` with every tensor in it (through dicts, lists and tuples) on `device`, dtype kept; one
    already there is returned as is, a pinned one is copied without waiting for the copy."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=x.device.type == "cpu" and device.type == "cuda" and x.is_pinned())
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):      # a namedtuple
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x
