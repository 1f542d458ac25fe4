"""The fine-tuning loop: lr schedule, one epoch of training, validation, checkpoints (AdamW: Models/kernels/adamw.py).

Loss across ranks and accumulation steps is exact: an optimizer step sees the
accum_iter global batches G, holding N = sum(mask) target tokens in all. Rank r
back-propagates its local sum(mask * nll) * world / N; Jittor's optimizer
averages gradients over the ranks (mpi_all_reduce "mean" inside backward), so
the summed gradient is that of sum over G of mask * nll / N, the same number
whether 1 or 8 ranks share G. N is counted on the host from the dataset, so it
costs no communication. The sparse baselines' load-balancing term rides along in
the loss: its gradient is the target-weighted mean of the micro-batches' terms (the
authors' is the plain mean over GPUs); the logged train_loss is the cross-entropy
alone and aux_loss that term, averaged over micro-batches and ranks.

MPI rule: every rank runs the same Jittor ops in the same order; rank 0 alone
only prints and writes files (numbers fetched beforehand on every rank).
"""
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt

from Models.formats.training import checkpoint_state, save_checkpoint
from Models.kernels.finite import nonfinite_count
from Utils.file_io import atomic_write
from Utils.misc import MetricLogger, SmoothedValue, all_reduce_sum, is_main_process, print_main
from Utils.settings import TrainArgs


class NonFiniteLoss(RuntimeError):
    """The training or validation loss, or the adapter's weights, became NaN or inf; nothing is saved, so
    checkpoint-latest.pth keeps the last finite state."""


def lr_at(step, total_steps, warmup_steps, lr, min_lr, schedule="cosine"):
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then half-cycle cosine to min_lr
    (schedule "cosine") or lr itself to the end ("constant")."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_gradients(optimizer, max_norm):
    """Global L2 norm of the (rank-averaged) gradients; scales them down to max_norm when > 0."""
    grads = [g for pg in optimizer.param_groups for g in pg["grads"]]
    norm = jt.sqrt(sum((g * g).sum() for g in grads))
    if max_norm > 0:
        coef = jt.minimum(max_norm / (norm + 1e-6), 1.0)
        for g in grads:
            g.update(g * coef)
    return norm


def target_count(dataset, epoch, step):
    """Target tokens (mask[1:]) in global batch `step` over all ranks, from the host-side encodings."""
    return sum(float(dataset.encoded[i][1][1:].sum()) for i in dataset.global_batch_indices(epoch, step) if i >= 0)


def evaluate(model, dataset):
    """Validation loss: sum(mask * nll) / sum(mask) over every example and rank."""
    nll_sum = count = 0.0
    model.eval()
    with jt.no_grad():
        for tokens, mask in dataset.batches(0):
            loss, _ = model(jt.array(tokens), jt.array(mask), with_logits=False)
            n = float(mask[:, 1:].sum())
            nll_sum += loss.item() * n
            count += n
    model.train()
    nll_sum, count = all_reduce_sum([nll_sum, count])
    return float(nll_sum / max(count, 1.0))


# ---- training --------------------------------------------------------------------

@dataclass(frozen=True)
class RunContext:
    """What the loop reads but never changes: where to write, the ranks, validation, stopping rules."""
    output_dir: str
    world_size: int
    steps_per_epoch: int
    val_dataset: Any
    stopper: Any  # Utils.misc.EarlyStopper (keeps its own counters)
    log_writer: Any  # tensorboardX SummaryWriter on rank 0, None elsewhere
    stop: Any  # Utils.jittor_env.StopFlag
    settings: dict  # the run's resolved settings, saved into every checkpoint
    signature: dict  # what a resume must match (Models.formats.training.resume_signature)
    run_id: str = ""  # on every log line: which run wrote it
    run_dir: Any = None  # Utils.output_dirs.RunDir on rank 0 (its manifest lists what the run writes), else None


class Throughput:
    """Training tokens per second of the steps that compile nothing: a step that meets a batch shape for the
    first time in this process builds Jittor's kernels for it (the first step's compiling alone made one method
    look three times as fast as a cheaper one), so the steps with a new shape are left out."""

    def __init__(self):
        self.shapes, self.tokens, self.seconds, self.steps = set(), 0, 0.0, 0

    def new(self, shapes) -> bool:
        """Whether a step of micro-batches of these [B, L] shapes meets one for the first time."""
        return not set(shapes) <= self.shapes

    def add(self, shapes, tokens: int, seconds: float, compiled: bool):
        """One optimizer step: its micro-batches' shapes, its input tokens and time, whether a rank met a new
        shape in it (new() on every rank, summed)."""
        if not compiled:
            self.tokens, self.seconds, self.steps = self.tokens + tokens, self.seconds + seconds, self.steps + 1
        self.shapes |= set(shapes)

    @property
    def tokens_per_s(self):
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class Progress:
    """Where a run stands: restored from a checkpoint, returned by train()."""
    epoch: int = 0
    next_batch: int = 0  # the global batch the next optimizer step starts from
    global_step: int = 0
    stop_reason: Optional[str] = None  # 'max_steps', 'signal' or 'early_stop'
    input_tokens: int = 0  # padded inputs over all ranks
    train_seconds: float = 0.0
    timed: Throughput = field(default_factory=Throughput)  # tokens/s without the steps that compile
    unlogged: list = field(default_factory=list)  # the train losses since the last log.txt line (its step_losses)

    def position(self) -> dict:
        return {"epoch": self.epoch, "data_iter_step": self.next_batch, "global_step": self.global_step}


def log_line(ctx, record):
    """One JSON line in <output_dir>/log.txt (rank 0), tagged with the run's id."""
    if is_main_process():
        with open(os.path.join(ctx.output_dir, "log.txt"), "a") as f:
            f.write(json.dumps({"run": ctx.run_id, **record}) + "\n")


def log_step_losses(ctx, progress):
    """The train losses of the steps since the last log.txt line, as a line of their own (the loss curve's)."""
    if progress.unlogged:
        log_line(ctx, {"event": "step_losses", "step": progress.global_step, "step_losses": progress.unlogged})
        progress.unlogged = []


def cut_log(output_dir: str, step: int):
    """log.txt as the checkpoint a run starts from left it (rank 0): the lines of later steps go, as tensorboard's
    purge_step drops its events, so that a run resumed after a kill -9 (or from an earlier checkpoint) does not
    log those steps twice."""
    path = os.path.join(output_dir, "log.txt")
    if not is_main_process() or not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if logged_step(line) <= step]
    if len(kept) < len(lines):
        def write(tmp):
            with open(tmp, "w") as out:
                out.writelines(kept)
        atomic_write(path, write)


def logged_step(line: str) -> float:
    """The step a log.txt line is of (0: none); a line a kill cut short is of no step that stays."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return math.inf


LOWER_LR = "try a lower --blr/--lr or --clip_grad"


def non_finite(what: str, progress, ctx, advice: str = None) -> NonFiniteLoss:
    """The stop on a non-finite number: what and where, the checkpoint only where one exists, and `advice`
    (by default a lower learning rate, which can help only once the lr has acted: after step 1)."""
    saved = os.path.isfile(os.path.join(ctx.output_dir, "checkpoint-latest.pth"))
    kept = "checkpoint-latest.pth holds the last finite state" if saved else "no checkpoint was saved yet"
    if advice is None:
        advice = (LOWER_LR if progress.global_step > 1 else
                  "at the first step no setting of the optimizer is the cause: check the base and its --precision")
    return NonFiniteLoss(f"{what} at step {progress.global_step} (epoch {progress.epoch}); stopping without saving "
                         f"({kept}); {advice}")


def non_finite_weights(optimizer, lr: float, progress, ctx) -> NonFiniteLoss:
    """The stop on adapter weights an update made non-finite: the tensors, each with its step's largest
    gradient, and advice by what the gradients were (AdamW moves a weight by about lr at most, so from finite
    gradients no learning rate short of 1e30 makes one non-finite)."""
    tensors = [(name, p, g) for pg in optimizer.param_groups for name, p, g in zip(pg["names"], pg["params"], pg["grads"])]
    counts = [(name, g, int((~np.isfinite(p.numpy())).sum())) for name, p, g in tensors]
    bad = [(name, float(np.abs(g.numpy()).max()) if g.numel() else 0.0, count) for name, g, count in counts if count]
    listed = ", ".join(f"{name} ({count} of them, largest |gradient| {top:.3g})" for name, top, count in bad[:4])
    more = f" and {len(bad) - 4} more tensors" if len(bad) > 4 else ""
    if all(math.isfinite(top) for _, top, _ in bad):
        advice = ("their gradients were finite, so the update itself failed, which no setting causes: please "
                  "report it with this line")
    else:
        advice = None  # the gradients overflowed: the loss's backward
    return non_finite(f"adapter weights not finite after the update (lr {lr:.3g}): {listed}{more}", progress, ctx, advice)


def save(ctx, model, optimizer, progress, best=False):
    """checkpoint-latest (and with best, checkpoint-best + adapter-best); every rank calls it."""
    state = checkpoint_state(model, optimizer, ctx.stopper, progress.position(), ctx.settings, ctx.signature)
    if ctx.run_dir is not None:
        ctx.run_dir.record("checkpoint-latest.pth", *(("checkpoint-best.pth", "adapter-best") if best else ()))
    if best:
        save_checkpoint(state, ctx.output_dir, "best", with_adapter=True)
    save_checkpoint(state, ctx.output_dir, "latest")


def validate_and_save(ctx, model, optimizer, progress):
    """Validation (when there is a val set), the early stopper, the checkpoints."""
    improved = False
    if ctx.val_dataset is not None:
        val_loss = evaluate(model, ctx.val_dataset)
        if not math.isfinite(val_loss):
            raise non_finite(f"validation loss is {val_loss}", progress, ctx, LOWER_LR)
        improved, should_stop = ctx.stopper.step(val_loss)
        print_main(f"[val] step {progress.global_step}: val_loss {val_loss:.4f} (best {ctx.stopper.best:.4f})"
                   f"{' improved' if improved else ''}")
        if ctx.log_writer is not None:
            ctx.log_writer.add_scalar("val_loss", val_loss, progress.global_step)
        log_line(ctx, {"event": "val", "step": progress.global_step, "epoch": progress.epoch, "val_loss": val_loss,
                       "best_val_loss": ctx.stopper.best})
        if should_stop:
            print_main(f"[early stop] no improvement in {ctx.stopper.patience} validations; "
                       f"best {ctx.stopper.best:.4f}")
            progress.stop_reason = "early_stop"
    save(ctx, model, optimizer, progress, best=improved)


def train(model, dataset, optimizer, cfg: TrainArgs, ctx: RunContext, start: Progress) -> Progress:
    """Optimizer steps from `start` to the end of the last epoch or an early stop; returns where it ended."""
    progress = replace(start)
    if cfg.max_steps and progress.global_step >= cfg.max_steps:
        progress.stop_reason = "max_steps"
    elif ctx.stopper.stopped:  # a resumed run that had stopped early: its patience stays spent
        progress.stop_reason = "early_stop"
    while progress.epoch < cfg.epochs and progress.stop_reason is None:
        train_one_epoch(model, dataset, optimizer, cfg, ctx, progress)
        if progress.stop_reason is None:
            progress.epoch, progress.next_batch = progress.epoch + 1, 0
    return progress


def train_one_epoch(model, dataset, optimizer, cfg: TrainArgs, ctx: RunContext, progress: Progress):
    """The optimizer steps of progress.epoch from global batch progress.next_batch (a multiple of
    accum_iter); advances `progress`, setting stop_reason when the run must end early."""
    world, epoch = ctx.world_size, progress.epoch
    first, last = progress.next_batch // cfg.accum_iter, ctx.steps_per_epoch
    # the steps that will run: --max_steps may end the run inside this epoch (the ETA counts these)
    end = min(last, first + cfg.max_steps - progress.global_step) if cfg.max_steps else last
    total_steps = cfg.epochs * ctx.steps_per_epoch
    warmup_steps = cfg.warmup_steps or int(round(cfg.warmup_epochs * ctx.steps_per_epoch))
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.3e}"))
    header = f"Epoch: [{epoch}]"
    for opt_step in metric_logger.log_every(range(first, end), cfg.log_interval, header, total=end - first):
        started = time.time()
        batch_steps = range(opt_step * cfg.accum_iter, (opt_step + 1) * cfg.accum_iter)
        n_targets = sum(target_count(dataset, epoch, s) for s in batch_steps)
        lr = lr_at(progress.global_step, total_steps, warmup_steps, cfg.lr, cfg.min_lr, cfg.lr_schedule)
        optimizer.lr = lr
        for pg in optimizer.param_groups:
            pg["lr"] = lr

        local_nll, local_targets, input_tokens, local_aux, shapes = 0.0, 0.0, 0, 0.0, []
        for tokens, mask in itertools.islice(dataset.batches(epoch, batch_steps[0]), cfg.accum_iter):
            count = float(mask[:, 1:].sum())
            loss, _ = model(jt.array(tokens), jt.array(mask), with_logits=False)
            # local share of sum(mask*nll)/N; backward's rank mean then gives the global gradient
            optimizer.backward(loss * (count * world / max(n_targets, 1.0)))
            parts = model.last_loss_parts  # the cross-entropy, and the sparse baselines' load-balancing term
            jt.sync([loss, *parts.values()] + [g for pg in optimizer.param_groups for g in pg["grads"]])
            local_nll += parts["ce"].item() * count
            local_aux += parts["aux"].item() if "aux" in parts else 0.0
            local_targets += count
            input_tokens += tokens.size
            shapes.append(tokens.shape)
        nll_sum, targets, input_tokens, aux_sum, new_shapes, *stop_votes = all_reduce_sum(
            [local_nll, local_targets, input_tokens, local_aux, float(progress.timed.new(shapes)), *ctx.stop.votes()])
        train_loss = float(nll_sum / max(targets, 1.0))
        aux_loss = float(aux_sum / (cfg.accum_iter * world)) if "aux" in parts else None
        if not math.isfinite(train_loss):
            raise non_finite(f"training loss is {train_loss}", replace(progress, global_step=progress.global_step + 1), ctx)
        grad_norm = clip_gradients(optimizer, cfg.clip_grad)
        optimizer.step()
        adapter = list(model.adapter_parameters().values())
        bad = nonfinite_count(adapter)  # one small op: the step's weights, before anything can save them
        jt.sync(adapter + [grad_norm, bad])
        grad_norm = grad_norm.item()
        progress.global_step += 1
        if bad.item() > 0:
            raise non_finite_weights(optimizer, lr, progress, ctx)
        seconds = time.time() - started
        progress.input_tokens += int(input_tokens)
        progress.train_seconds += seconds
        progress.timed.add(shapes, int(input_tokens), seconds, compiled=new_shapes > 0)
        progress.next_batch = (opt_step + 1) * cfg.accum_iter

        metric_logger.update(loss=train_loss, lr=lr, grad_norm=grad_norm, **({} if aux_loss is None else {"aux_loss": aux_loss}))
        if ctx.log_writer is not None:
            ctx.log_writer.add_scalar("c_train_loss", train_loss, progress.global_step)
            ctx.log_writer.add_scalar("lr", lr, progress.global_step)
            if aux_loss is not None:
                ctx.log_writer.add_scalar("aux_loss", aux_loss, progress.global_step)
        progress.unlogged.append(round(train_loss, 6))
        if progress.global_step % cfg.log_interval == 0 or progress.global_step == 1:
            log_line(ctx, {"event": "train", "step": progress.global_step, "epoch": epoch, "train_loss": train_loss,
                           **({} if aux_loss is None else {"aux_loss": aux_loss}),
                           "lr": lr, "grad_norm": grad_norm, "tokens": int(input_tokens),
                           "step_losses": progress.unlogged})  # every step's loss: the loss curve has them all
            progress.unlogged = []

        saved = opt_step + 1 == last or (cfg.eval_interval > 0 and progress.global_step % cfg.eval_interval == 0)
        if saved:
            log_step_losses(ctx, progress)  # before each checkpoint: a resumed run's log has every step before it
            validate_and_save(ctx, model, optimizer, progress)
        if ctx.stop.agree(stop_votes):  # summed over ranks, so every rank stops at the same step
            progress.stop_reason = "signal"
        elif cfg.max_steps and progress.global_step >= cfg.max_steps and progress.stop_reason is None:
            progress.stop_reason = "max_steps"
        if progress.stop_reason is not None:
            if not saved:
                log_step_losses(ctx, progress)
                save(ctx, model, optimizer, progress)
            if opt_step + 1 < end:  # at `end` the loop ends by itself, its last progress line printed
                break
    metric_logger.synchronize_between_processes()
    print_main(f"{header} averaged stats: {metric_logger}")
