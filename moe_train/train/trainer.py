"""The training loop on a DeepSpeed engine.

The trainer owns `deepspeed.initialize`. Loss normalisation: every micro-batch's summed loss is
divided by the target tokens of the whole optimizer step over all ranks (`step_tgt_tokens`) and
multiplied by world_size * grad_accum, which DeepSpeed's gradient averaging and accumulation
scaling divide out again; so the update equals one process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import deepspeed
import numpy as np
import torch

from moe_train.config.schema import ExperimentConfig
from moe_train.data.batching import Batch, TrainBatchIterator, eval_batches
from moe_train.data.prepare import load_manifest, load_vocab, tokenizer_files
from moe_train.data.shards import ShardedDataset, nonempty_split
from moe_train.errors import ConfigError, MoeTrainError
from moe_train.eval.decode import batch_context
from moe_train.eval.evaluate import evaluate_dataset
from moe_train.models.lm_batch import teacher_forced
from moe_train.parallel.zero3 import (full_numel, mark_moe_leaf_modules, register_tied_outputs,
                                      zero3_grad_norm)
from moe_train.models.build import moe_layers
from moe_train.parallel.collectives import (all_reduce_floats, clip_gradients,
                                            global_grad_norm, raise_if_any_rank_failed,
                                            read_values, step_decision)
from moe_train.parallel.expert_checkpoint import detach_experts_from_state_dict, expert_modules
from moe_train.parallel.step_guard import (check_zero_optimizer, loss_scale, skipped_update,
                                           zero_grad_norm)
from moe_train.parallel.expert_parallel import (check_moe_against_data,
                                                deepspeed_sees_moe_layers, moe_param_groups,
                                                setup_expert_parallel, wire_expert_parallel)
from moe_train.parallel.runtime import ParallelRuntime
from moe_train.train.checkpoint import latest_tag, read_meta
from moe_train.train.checkpointer import ENDED, Checkpointer
from moe_train.train.ds_config import build_deepspeed_config, deepspeed_config_errors
from moe_train.train.init_from import build_start_model
from moe_train.train.early_stop import EarlyStop
from moe_train.train.hooks import TrainerHooks, accumulate, add_ratios, hooks_for, window_ratios
from moe_train.train.log_window import STEP_SUMS, LogWindow, moe_layer_stats
from moe_train.train.loss import label_smoothed_nll, per_token_bits
from moe_train.train.param_groups import param_groups
from moe_train.train.monitor import Monitor, peak_memory_mb
from moe_train.train.preempt import STOP_SIGNALS, Preempted, StopSignals
from moe_train.train.resume import resume_state
from moe_train.train.schedule import inverse_sqrt_scheduler


class Trainer:
    """Builds data, model and engine from a config; trains, validates, checkpoints, exports."""

    def __init__(self, cfg: ExperimentConfig, rt: ParallelRuntime, resume: bool = False,
                 hooks: Sequence[TrainerHooks] = ()) -> None:
        """`hooks` (train/hooks.py) come after those the config's methods register: their
        `init_model` runs on the freshly built single-device model, before expert parallelism
        and the engine (stages load earlier weights and freeze parameters there; parameters
        with requires_grad False get no optimizer state and never change)."""
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.cfg, self.rt = cfg, rt
        self.hooks = hooks_for(cfg, hooks)
        prepared = Path(cfg.data.prepared_dir)
        self.manifest = load_manifest(prepared)
        self.vocab = load_vocab(prepared)
        self.tokenizer_files = tokenizer_files(prepared, self.manifest)
        self.train_set = nonempty_split(prepared, "train")
        dev = ShardedDataset(prepared, "dev") if "dev" in self.manifest["splits"] else None
        self.dev_set = dev if dev is not None and len(dev) else None  # empty: no validation
        if self.dev_set is None and cfg.train.patience:
            raise ConfigError(f"train.patience: early stopping validates on the dev split, but "
                              f"{prepared / 'dev'} holds no sentences; set train.patience=0")
        if self.dev_set is None and cfg.train.validate_every:
            self._log_main(f"| {prepared / 'dev'}: no sentences; training without validation")

        if cfg.uses_experts:
            check_moe_against_data(cfg, self.manifest)
            rt = self.rt = setup_expert_parallel(rt, cfg.moe.ep_size)
        torch.manual_seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        ckpt_dir = Path(cfg.checkpoint.dir)
        tag = latest_tag(ckpt_dir, warn=self._log_main) if resume else None
        self.ds_config = build_deepspeed_config(cfg, rt.world_size, rt.device)
        # identical on every rank (same seed, or the same init_from weights)
        model, loaded = build_start_model(cfg, self.manifest, self.ds_config, rt.is_main,
                                          load=tag is None)
        if loaded:
            self._log_main(f"| init_from {cfg.train.init_from}: {loaded / 1e6:.2f}M weights")
        self.hooks.init_model(model)
        if cfg.uses_experts:
            wire_expert_parallel(model, rt)
            detach_experts_from_state_dict(model)
        groups = param_groups(model, cfg.optim.weight_decay)
        if cfg.uses_experts:
            groups = moe_param_groups(model, groups, rt.ep_size)
        optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=cfg.optim.betas,
                                      eps=cfg.optim.eps)
        scheduler = inverse_sqrt_scheduler(optimizer, cfg.optim.warmup_steps)
        if cfg.optim.zero_stage == 3:
            mark_moe_leaf_modules(model)
            register_tied_outputs(model)
        detect = deepspeed_sees_moe_layers() if rt.ep_size > 1 else contextlib.nullcontext()
        with detect, deepspeed_config_errors(cfg.deepspeed):
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                        lr_scheduler=scheduler,
                                                        config=self.ds_config,
                                                        dist_init_required=False)
        if cfg.optim.zero_stage in (1, 2):
            check_zero_optimizer(self.engine.optimizer)
        self.batches = TrainBatchIterator(
            self.train_set, cfg.data.max_tokens, self.vocab.pad_id, self.vocab.bos_id,
            self.vocab.eos_id, seed=cfg.train.seed, temperature=cfg.data.temperature,
            dp_rank=rt.dp_rank, dp_world=rt.dp_world, grad_accum=cfg.optim.grad_accum)
        self.step = 0
        self.tokens_seen = 0
        self.tokens_unsaved = 0.0  # tokens this rank trained on since tokens_seen was updated
        self.window = LogWindow()  # this rank's sums for the next log line
        self.last_lr: float | None = None  # the learning rate of the last update
        self.moe_layers = moe_layers(self.engine.module)
        self.expert_param_ids = {id(p) for _, m in expert_modules(self.engine.module)
                                 for p in m.parameters()}
        self.last_grad_norm: float | None = None
        self.nonfinite_steps = 0  # skipped steps in this run, and the current streak (both
        self.nonfinite_in_a_row = 0  # travel in checkpoints: a resume continues the streak)
        tc = cfg.train
        self.early = EarlyStop(tc.early_stop_metric, tc.patience, tc.min_delta)
        self.checkpoints = Checkpointer(self.engine, rt, cfg, self.manifest,
                                        self.tokenizer_files, self._log_main)
        if resume and tag is None:
            self._log_main(f"| resume: no checkpoint in {ckpt_dir}; starting from step 0")
        self.resumed = tag is not None
        self.validated_step = -1  # the last step whose validation early stopping has seen
        if tag is None:
            self.checkpoints.forget_end()
        else:  # strict: the config must match (train/resume.py)
            meta_path = self.checkpoints.dir / tag / "meta.json"
            state = resume_state(read_meta(meta_path.parent), meta_path)
            self.checkpoints.load(tag)
            self.step, self.tokens_seen = state.step, state.tokens_seen
            self.batches.load_state_dict(state.data_state)
            self.early.load_state_dict(state.early_stop)
            self.checkpoints.adopt_best(state.early_stop.get("best_tag"))
            self._resume_nonfinite(state.nonfinite_total, state.nonfinite_in_a_row)
            self.validated_step = state.validated_step
            self._resume_window(meta_path.parent, state.world_size)
        self.monitor = Monitor(rt, cfg.logging.tensorboard_dir, cfg.train.max_steps, self.step,
                               cfg.train.progress_bar)
        # the whole model: each rank holds 1/ep_size of the experts
        n_params = sum(full_numel(p) * (rt.ep_size if id(p) in self.expert_param_ids else 1)
                       for p in model.parameters())
        self.monitor.print(
            f"| model {n_params / 1e6:.2f}M parameters | world {rt.world_size} ({rt.launcher}, "
            f"{rt.backend}) | device {rt.device} | zero {cfg.optim.zero_stage} | "
            f"train {len(self.train_set)} pairs | resume from step {self.step}")

    # ------------------------------------------------------------------ one optimizer step
    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward: (scaled loss with aux and hook losses, loss sum, nll sum); aux losses
        go to the log window's `aux`, hook metrics to its `metrics`. Nothing is read from the
        device: the sums (detached) stay there until a log line reads them at once."""
        ctx = batch_context(batch, self.vocab.pad_id, len(self.manifest["langs"]))
        extras = self.hooks.batch_extras(batch)
        if extras:
            ctx = ctx.replace(extras={**ctx.extras, **extras})
        out = teacher_forced(self.engine, batch.src_tokens_BS, batch.tgt_in_BT, ctx,
                             self.vocab.pad_id, self.cfg.decoder_only)
        loss_sum, nll_sum = label_smoothed_nll(out.logits_BTV, batch.tgt_out_BT,
                                               self.vocab.pad_id, self.cfg.optim.label_smoothing)
        scale = self.rt.world_size * self.cfg.optim.grad_accum / batch.step_tgt_tokens
        scaled = loss_sum * scale
        for key, aux in {**out.aux_losses, **self.hooks.extra_losses(out, batch)}.items():
            scaled = scaled + aux
            self.window.aux[key] = accumulate(self.window.aux.get(key, 0.0), aux)
        add_ratios(self.window.metrics, self.hooks.metrics(out, batch))
        return scaled, loss_sum.detach(), nll_sum.detach()

    def _metric_sums(self, window: dict[str, list[Any]]) -> tuple[list[str], list[Any]]:
        """(names, their numerator and denominator sums in order) of a window's hook metrics.
        Every rank reduces the same names: the hooks' declared ones, present or not (0 / 0)."""
        names = sorted(set(window) | set(self.hooks.metric_names))
        return names, [v for n in names for v in window.get(n, (0.0, 0.0))]

    def _grad_norm(self) -> float | torch.Tensor | None:
        """The global norm of the unscaled (fp16: loss scale divided out) gradients, counting
        each expert once. Under ZeRO 0 we compute it (a device tensor that `train_step` reads
        with its finite check, then clips: DeepSpeed's engine-level clipping does not know
        which parameters are experts); under ZeRO 1/2 DeepSpeed's optimizer clips in
        `engine.step()` with its own, equal, norm."""
        if self.cfg.optim.zero_stage == 0:
            return global_grad_norm(self.engine.module, self.expert_param_ids, self.rt,
                                    loss_scale(self.engine))
        if self.cfg.optim.zero_stage == 3:
            return zero3_grad_norm(self.engine.optimizer)
        return zero_grad_norm(self.engine.optimizer)

    def train_step(self) -> dict[str, Any]:
        """Consume one optimizer step of micro-batches; returns local sums for logging (loss
        and nll as float64 device tensors, read by the log line).

        A step whose loss or global gradient norm is not finite on some rank is skipped on all
        ranks (one agreed decision, the step's one host sync): no parameter, optimizer-moment
        or lr-scheduler change, the gradients are dropped; its sums are zero and `nonfinite` is 1,
        and its aux losses and metrics leave the log window.
        """
        self.engine.train()
        loss_tot = nll_tot = 0.0  # float64 device tensors once a micro-batch is added
        ntok = 0
        micro = next(self.batches)
        self.last_grad_norm = None
        finite, before = True, self.window.mark()
        for i, batch in enumerate(micro):
            batch = batch.to(self.rt.device)
            scaled, loss_sum, nll_sum = self._forward_loss(batch)
            self.engine.backward(scaled)
            loss_tot, nll_tot = accumulate(loss_tot, loss_sum), accumulate(nll_tot, nll_sum)
            ntok += batch.n_tgt_tokens
            self.window.aux_micro_batches += 1
            if i < len(micro) - 1:
                self.engine.step()  # accumulating: no update yet
                continue
            # gradients are reduced at the accumulation boundary
            finite, self.last_grad_norm = step_decision(self.rt, loss_tot, self._grad_norm())
            if self.cfg.optim.zero_stage == 0:
                clip_gradients(self.engine.module, self.last_grad_norm, self.cfg.optim.clip_norm)
            self.last_lr = self.engine.get_lr()[0]  # before the scheduler moves on
            with contextlib.nullcontext() if finite else skipped_update(self.engine):
                self.engine.step()
        self.step += 1
        if not finite:
            self.window.rollback(before)
            return {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "nonfinite": 1.0}
        return {"loss": loss_tot, "nll": nll_tot, "tokens": float(ntok), "nonfinite": 0.0}

    def _resume_window(self, tag_dir: Path, world_size: int) -> None:
        """The log window the checkpoint's run had open (at the same world size), so the first
        line after a resume reports what an uninterrupted run's would."""
        window = (LogWindow.load(tag_dir, self.rt.rank, self.rt.device)
                  if world_size == self.rt.world_size else None)
        if window is not None:
            self.window = window
        elif self.step % self.cfg.train.log_every:
            self._log_main(f"| resume: the first log line averages the steps after step "
                           f"{self.step} only (no log window of world size "
                           f"{self.rt.world_size} in the checkpoint)")

    def _resume_nonfinite(self, total: int, in_a_row: int) -> None:
        """Continue the skipped-step counts of the checkpoint: a run saved in the middle of a
        streak of non-finite steps (skipped steps leave the parameters finite, so they are
        saved) gets no fresh allowance of `optim.max_nonfinite_steps` by being resumed."""
        self.nonfinite_steps, self.nonfinite_in_a_row = total, in_a_row
        if self.nonfinite_in_a_row:
            self._log_main(f"| resume: {self.nonfinite_in_a_row} non-finite steps in a row so "
                           f"far (optim.max_nonfinite_steps {self.cfg.optim.max_nonfinite_steps})")

    def _count_nonfinite(self, skipped: bool) -> None:
        """Log a skipped step; stop after `optim.max_nonfinite_steps` of them in a row (every
        rank raises together: the decision was collective)."""
        if not skipped:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        limit = self.cfg.optim.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit or self.step % self.cfg.train.log_every:
            # (a log step's scalars carry it, once: _log)
            self.monitor.scalars(self.step, {"train/nonfinite_steps": float(self.nonfinite_steps)})
        self.monitor.print(
            f"| step {self.step:>6} | non-finite loss or gradient norm (grad norm "
            f"{self.last_grad_norm}): update skipped on every rank | {self.nonfinite_in_a_row} "
            f"in a row, {self.nonfinite_steps} in total")
        if self.nonfinite_in_a_row >= limit:
            raise MoeTrainError(
                f"optim.max_nonfinite_steps: {limit} consecutive steps (up to step {self.step}) "
                f"had a non-finite loss or gradient norm; stopped; last good checkpoint: "
                f"{self.checkpoints.last_good()}")

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate_loss(self) -> dict[str, float]:
        """Dev-set loss and perplexity (token-weighted over all ranks)."""
        assert self.dev_set is not None
        self.engine.eval()
        aux = dict(self.window.aux)  # dev batches do not count as training aux losses
        metrics, self.window.metrics = self.window.metrics, {}
        loss = nll = tokens = 0.0  # loss and nll: float64 device tensors after a batch
        for batch in eval_batches(self.dev_set, self.cfg.data.max_tokens, self.vocab.pad_id,
                                  self.vocab.bos_id, self.vocab.eos_id, dp_rank=self.rt.dp_rank,
                                  dp_world=self.rt.dp_world):
            batch = batch.to(self.rt.device)
            _, loss_sum, nll_sum = self._forward_loss(batch)
            if not batch.is_padding:
                loss, nll = accumulate(loss, loss_sum), accumulate(nll, nll_sum)
                tokens += batch.n_tgt_tokens
        names, sums = self._metric_sums(self.window.metrics)
        (loss, nll, tokens, *sums), _ = read_values(self.rt, [loss, nll, tokens, *sums])
        dev_metrics = window_ratios(names, sums, "dev/")
        self.window.aux, self.window.metrics = aux, metrics
        self.engine.train()
        return {**per_token_bits(loss, nll, tokens, "dev/"), **dev_metrics}

    def validate_bleu(self, sentences: int, beam: int = 1) -> dict[str, Any]:
        """Dev BLEU/chrF (per domain) on about `sentences` dev pairs: the first
        `sentences` // corpora of each corpus (at least one each)."""
        assert self.dev_set is not None
        ds = self.dev_set
        per = max(1, sentences // max(ds.num_corpora, 1))
        idx = np.concatenate([np.arange(o, o + min(per, n))
                              for o, n in zip(ds.corpus_offsets, ds.corpus_sizes)])
        metrics, _ = evaluate_dataset(self.engine.module, ds, self.vocab, self.manifest, self.rt,
                                      self.cfg.eval, self.cfg.data.max_tokens, indices=idx,
                                      beam=beam)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint this step (all ranks): the engine, the data order, early stopping and
        the skipped-step counts, so that `--resume` continues exactly here."""
        return self.checkpoints.save(self.step, self._checkpoint_meta,
                                     rank_extra=lambda tag_dir: self.window.save(tag_dir,
                                                                                 self.rt.rank))

    def _checkpoint_meta(self) -> dict[str, Any]:
        (tokens,) = all_reduce_floats(self.rt, self.tokens_unsaved)
        self.tokens_seen += int(tokens)
        self.tokens_unsaved = 0.0
        return {"step": self.step, "tokens_seen": self.tokens_seen,
                "data_state": self.batches.state_dict(), "config": self.cfg.to_dict(),
                "world_size": self.rt.world_size,
                "early_stop": self.early.state_dict() | {"best_tag": self.checkpoints.best_tag},
                "nonfinite": {"total": self.nonfinite_steps,
                              "in_a_row": self.nonfinite_in_a_row},
                "validated_step": self.validated_step}

    def _note_validation(self, values: dict[str, Any], scheduled: bool = True) -> bool:
        """Feed a validation to early stopping (`scheduled`: on the train.validate_every
        schedule, see EarlyStop.update); checkpoint a new best (train.export_best). Returns
        whether the run has plateaued; ranks agree on both decisions."""
        plateau = self.early.update(self.step, values, scheduled)
        improved = self.early.improved
        if self.rt.world_size > 1:  # ranks decide together (the save is collective)
            plateau, improved = (v > 0 for v in all_reduce_floats(self.rt, float(plateau),
                                                                  float(improved)))
        if improved and self.checkpoints.mark_best(self.step):
            self.save()
        return plateau

    def _log_main(self, msg: str) -> None:
        """A line from rank 0 (before the monitor exists: resume messages)."""
        if self.rt.is_main:
            print(msg, flush=True)

    # ------------------------------------------------------------------ the loop
    def _log(self) -> None:
        """The log window's line: its sums, aux losses and MoE layer scalars, read at once;
        a new window starts."""
        window, self.window = self.window, LogWindow()
        elapsed = window.elapsed()
        names, sums = self._metric_sums(window.metrics)
        layers = moe_layer_stats(self.moe_layers)
        (loss, nll, tokens, *sums), local = read_values(
            self.rt, [*(window.sums[k] for k in STEP_SUMS), *sums],
            [*window.aux.values(), *(v for _, _, stats in layers for v in stats.values())])
        own = iter(local)  # this rank's values: the aux losses, then the layers' scalars
        if tokens == 0:  # every step of the window was skipped: no loss to report
            loss = nll = float("nan")
        tokens_per_s = tokens / max(elapsed, 1e-9)
        grad_norm = self.last_grad_norm
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        values = {**per_token_bits(loss, nll, tokens, "train/"),
                  "train/lr": (self.engine.get_lr()[0] if self.last_lr is None
                               else self.last_lr),
                  "train/tokens_per_s": tokens_per_s,
                  "train/memory_mb": peak_memory_mb(self.rt.device),
                  "train/epoch": float(self.batches.epoch)}
        if grad_norm is not None:
            values["train/grad_norm"] = float(grad_norm)
        values["train/nonfinite_steps"] = float(self.nonfinite_steps)
        for key in window.aux:  # over the window's own micro-batches (a resumed one's too)
            values[f"moe/aux_{key}"] = next(own) / max(window.aux_micro_batches, 1)
        values.update(window_ratios(names, sums, "train/"))
        self.monitor.scalars(self.step, values)
        for tag, counts, stats in layers:
            self.monitor.histogram(self.step, f"moe_tokens_per_expert/{tag}", counts)
            self.monitor.scalars(self.step, {key: next(own) for key in stats})
        self.monitor.progress(self.step, {"loss": f"{values['train/loss']:.3f}",
                                          "tok/s": f"{values['train/tokens_per_s']:.0f}"})
        if self.monitor.bar is None:
            self.monitor.print(
                f"| step {self.step:>6} | loss {values['train/loss']:.3f} | nll "
                f"{values['train/nll']:.3f} | ppl {values['train/ppl']:.2f} | lr "
                f"{values['train/lr']:.2e} | gnorm {values.get('train/grad_norm', 0.0):.2f} | "
                f"tok/s {values['train/tokens_per_s']:.0f} | mem {values['train/memory_mb']:.0f}MB")

    def _validate(self, with_bleu: bool, have: dict[str, Any] | None = None,
                  to_tensorboard: bool = True) -> dict[str, Any]:
        """Dev loss (and BLEU): logged and returned. `have`: this step's validation already
        done; only what it lacks (BLEU) is computed and logged. `to_tensorboard` False: printed
        only (resumed at a step the last run validated: it wrote this step's events)."""
        if self.dev_set is None:
            return {}
        values: dict[str, Any] = dict(have) if have is not None else self.validate_loss()
        fresh = {} if have is not None else dict(values)
        if with_bleu and "dev/bleu" not in values:
            metrics = self.validate_bleu(self.cfg.train.bleu_sentences)
            fresh["dev/bleu"] = metrics["all"]["bleu"]
            fresh["dev/chrf"] = metrics["all"]["chrf"]
            for dom, m in metrics["domains"].items():
                fresh[f"dev_bleu/{dom}"] = m["bleu"]
            values.update(fresh)
        if not fresh:
            return values
        msg = f"| valid step {self.step} | loss {values['dev/loss']:.3f} | ppl {values['dev/ppl']:.2f}"
        if "dev/task_accuracy" in values:
            msg += f" | task acc {values['dev/task_accuracy']:.4f}"
        if "dev/bleu" in values:
            msg += f" | greedy BLEU {values['dev/bleu']:.2f} | chrF {values['dev/chrf']:.2f}"
        if to_tensorboard:
            self.monitor.scalars(self.step, {k: float(v) for k, v in fresh.items()})
        self.monitor.print(msg)
        return values

    def fit(self) -> dict[str, Any]:
        """Train to `train.max_steps` (or `train.max_minutes`); checkpoint, validate, export.
        SIGTERM / SIGUSR1 stop it at the next step, saved, with `Preempted` (train/preempt.py).
        The TensorBoard writer is closed however it ends: a run stopped by an error keeps the
        steps that led there, and no writer thread outlives the run (a daemon thread left at
        interpreter exit can abort the process instead of its exit status 2)."""
        try:
            with StopSignals() as stops:
                self.loop_ended = False
                try:
                    summary, failed = self._fit(stops), None
                except Exception as exc:  # noqa: BLE001  (re-raised below)
                    if not self.loop_ended:  # in the loop: as before
                        raise
                    summary, failed = {}, exc  # rank 0's export or end record
                # Every rank that ended the loop agrees on a failure after it (rank 0 alone
                # writes the export) and on a signal during the final validation, save or
                # export: the run is saved, but a pipeline's next stage must not start.
                raise_if_any_rank_failed(self.rt, failed, f"{self.checkpoints.dir}: another "
                                         "rank failed at the end of training (its error line "
                                         "says why)")
                _, signum = self._agree(stops, False)
                if signum:
                    self._stop(signum, Path(summary.get("checkpoint") or self.checkpoints.dir))
                return summary
        finally:
            self.monitor.close()

    def _say_plateau(self) -> None:
        best = self.early.state()
        self.monitor.print(f"| early stop at step {self.step}: {best['metric']} best "
                           f"{best['best']:.4f} at step {best['best_step']}, no improvement "
                           f"in {self.cfg.train.patience} validations")

    def _stop(self, signum: int, checkpoint: Path) -> None:
        """End the run for a stop signal, `checkpoint` saved: one log line, then Preempted."""
        stop = Preempted(signum, self.step, checkpoint)
        self.monitor.print(f"| stopped: {stop}")
        raise stop

    def _agree(self, stops: StopSignals, flag: bool) -> tuple[bool, int]:
        """(`flag` on any rank: out of time, the stop signal any rank received or 0):
        one all-reduce, so that every rank stops at the same step."""
        values = [float(flag), *(float(stops.received == s) for s in STOP_SIGNALS)]
        if self.rt.world_size > 1:
            values = all_reduce_floats(self.rt, *values)
        return values[0] > 0, next((s for s, n in zip(STOP_SIGNALS, values[1:]) if n > 0), 0)

    def _fit(self, stops: StopSignals) -> dict[str, Any]:
        tc = self.cfg.train
        start = time.time()
        self.window.started = time.time()  # a resumed window's earlier seconds are kept
        paused = 0.0  # seconds in validation and checkpoints: not training time
        train_tokens_local = 0.0
        early, validated_at, last_values = self.early, -1, None
        ended = self.checkpoints.ended_at(self.step, tc.max_steps) if self.resumed else None
        if ended is not None:
            self.monitor.print(f"| resume: the run already ended at step {self.step} "
                               f"({'early stop' if ended.get('stopped_early') else 'max_steps'});"
                               f" nothing to train, its summary is in "
                               f"{self.checkpoints.dir / ENDED}")
            return ended | {"already_ended": True}  # its figures are the earlier run's
        # killed after its last save, before the end record: a plateau stays a plateau
        stopped_early = self.resumed and early.plateaued
        while self.step < tc.max_steps and not stopped_early:
            sums = self.train_step()
            self._count_nonfinite(bool(sums["nonfinite"]))
            self.window.add_step(sums)
            train_tokens_local += sums["tokens"]
            self.tokens_unsaved += sums["tokens"]
            if self.step % tc.log_every == 0:
                self._log()
            paused_at = time.time()  # validation and checkpoints do not count as training time
            self.window.begin_pause()
            plateau = False
            if tc.validate_every and self.step % tc.validate_every == 0 and self.step < tc.max_steps:
                bleu_due = (bool(tc.bleu_every) and self.step % tc.bleu_every == 0) or (
                    tc.patience > 0 and tc.early_stop_metric == "bleu")
                last_values = self._validate(with_bleu=bleu_due)
                # before a new best's checkpoint is written: its meta records this validation
                validated_at = self.validated_step = self.step
                plateau = self._note_validation(last_values)
            out_of_time = tc.max_minutes and (time.time() - start) / 60 >= tc.max_minutes
            out_of_time, signum = self._agree(stops, bool(out_of_time))
            # the last step is saved after the run's final validation, so that its checkpoint
            # holds the early-stopping state that validation leaves
            last = out_of_time or self.step >= tc.max_steps
            saved = None
            if not signum and self.step % self.cfg.checkpoint.save_every == 0 and not last:
                saved = self.save()
                _, signum = self._agree(stops, False)  # a signal during the save: stop here
            if signum:  # preempted (one rank signalled is enough): save here and go
                self._stop(signum, saved or self.save())
            pause_s = time.time() - paused_at
            self.window.end_pause()
            paused += pause_s
            if plateau:  # before the time limit: a run that plateaued has ended either way
                self._say_plateau()
                stopped_early = True
                break
            if out_of_time:
                self.monitor.print(f"| time limit of {tc.max_minutes} min reached at step {self.step}")
                break
        self.loop_ended = True  # what follows runs on every rank, then rank 0 writes
        self.window.begin_pause()  # the final validation and save are not the window's time
        ending = time.time()
        wall = ending - start
        elapsed = wall - paused  # the training steps alone
        (tokens,) = all_reduce_floats(self.rt, train_tokens_local)
        done_here = validated_at == self.step  # validated in the loop: add only BLEU
        # resumed where the last run validated (killed after its final save): its values for
        # the summary, but neither noted nor written again
        before = not done_here and self.validated_step == self.step
        final = self._validate(with_bleu=True, have=last_values if done_here else None,
                               to_tensorboard=not before)
        self.validated_step = self.step  # before a new best's checkpoint of this step is written
        if not done_here and not before:  # off the schedule (time limit, max_steps): best only
            if self._note_validation(final, scheduled=bool(tc.validate_every)
                                     and self.step % tc.validate_every == 0) \
                    and not stopped_early:  # the final scheduled validation plateaued
                self._say_plateau()
                stopped_early = True
        path = self.save()
        source = self.checkpoints.restore_best(path)
        if source != path:
            best = early.state()
            self.monitor.print(f"| export: the best validation, step {best['best_step']} "
                               f"({best['metric']} {best['best']:.4f}), not step {self.step}")
        export = self.checkpoints.export(source)
        end_s = time.time() - ending
        self.monitor.print(f"| saved {path}" + (f" | exported {export}" if export else "")
                           + f" | final validation, save and export took {end_s:.1f} s")
        exported: dict[str, Any] = {"exported_step": self.step}
        if source != path:
            exported = {"exported_step": early.best_step, "exported_dev": early.best_values}
        summary = {"step": self.step, "train_seconds": elapsed, "wall_seconds": wall,
                   "end_seconds": end_s,
                   "stopped_early": stopped_early,
                   **({"early_stop": early.state()} if tc.patience else {}), **exported,
                   "train_tokens_per_s": tokens / elapsed if tokens and elapsed > 0 else None,
                   "checkpoint": str(path), "export": str(self.checkpoints.export_dir), **final}
        if stopped_early or self.step >= tc.max_steps:  # not a time limit: that run goes on
            self.checkpoints.record_end(summary)
        return summary
