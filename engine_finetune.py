"""The fine-tuning loop: lr schedule, AdamW, one epoch of training, validation, checkpoints.

Loss across ranks and accumulation steps is exact: an optimizer step sees the
accum_iter global batches G, holding N = sum(mask) target tokens in all. Rank r
back-propagates its local sum(mask * nll) * world / N; Jittor's optimizer
averages gradients over the ranks (mpi_all_reduce "mean" inside backward), so
the summed gradient is that of sum over G of mask * nll / N, the same number
whether 1 or 8 ranks share G. N is counted on the host from the dataset, so it
costs no communication.

MPI rule: every rank runs the same Jittor ops in the same order; rank 0 alone
only prints and writes files (numbers fetched beforehand on every rank).
"""
import itertools
import json
import math
import os
import random
import signal
import time

import numpy as np

import Utils.jittor_env  # noqa: F401  (must precede the jittor import)
import jittor as jt

from Models.checkpoints import ADAPTER_PARAMS, ADAPTER_WEIGHTS, adapter_arrays
from Models.torch_io import save_pth
from Utils.misc import MetricLogger, SmoothedValue, all_reduce_sum, is_main_process, save_on_master


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf; the last good checkpoint is left untouched."""


def lr_at(step, total_steps, warmup_steps, lr, min_lr):
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then half-cycle cosine to min_lr."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class AdamW(jt.optim.AdamW):
    """jittor.optim.AdamW with bias correction counted in optimizer updates.

    Jittor's own AdamW takes the step count from `n_step`, which backward()
    increments, so under gradient accumulation its bias correction runs ahead.
    Everything else is Jittor's: decoupled weight decay p *= 1 - lr * wd per
    param group, and gradients averaged over MPI ranks inside backward().
    """

    def __init__(self, params, lr, eps=1e-8, betas=(0.9, 0.95), weight_decay=0.0):
        super().__init__(params, lr, eps=eps, betas=betas, weight_decay=weight_decay)
        self.updates = 0

    def step(self, loss=None, retain_graph=False):
        self.pre_step(loss, retain_graph)
        self.updates += 1
        n = float(self.updates)
        for pg in self.param_groups:
            lr, eps = pg.get("lr", self.lr), pg.get("eps", self.eps)
            weight_decay = pg.get("weight_decay", self.weight_decay)
            b0, b1 = pg.get("betas", self.betas)
            for p, g, v, m in zip(pg["params"], pg["grads"], pg["values"], pg["m"]):
                if p.is_stop_grad():
                    continue
                p.update(p * (1 - lr * weight_decay))
                m.update(b0 * m + (1 - b0) * g)
                v.update(b1 * v + (1 - b1) * g * g)
                denom = jt.sqrt(v) / math.sqrt(1 - b1 ** n) + eps
                p.update(p - (lr / (1 - b0 ** n)) * m / denom)
        self.post_step()

    def named_slots(self):
        """name -> (param, m, v) over all groups."""
        return {name: (p, m, v) for pg in self.param_groups
                for name, p, m, v in zip(pg["names"], pg["params"], pg["m"], pg["values"])}

    def state_arrays(self):
        """{'updates', 'm': {name: array}, 'v': {name: array}}; call on every rank."""
        slots = self.named_slots()
        return {"updates": self.updates,
                "m": {name: m.numpy().copy() for name, (_, m, _) in slots.items()},
                "v": {name: v.numpy().copy() for name, (_, _, v) in slots.items()}}

    def load_state_arrays(self, state, source):
        slots = self.named_slots()
        for key in ("m", "v"):
            if set(state[key]) != set(slots):
                raise ValueError(f"{source}: optimizer state names differ from the model's adapter parameters")
        for name, (p, m, v) in slots.items():
            for var, array in ((m, state["m"][name]), (v, state["v"][name])):
                if tuple(array.shape) != tuple(p.shape):
                    raise ValueError(f"{source}: optimizer state of '{name}' has shape {list(array.shape)}")
                var.update(jt.array(np.asarray(array, dtype=np.float32)))
        self.updates = int(state["updates"])


def build_optimizer(model, lr, weight_decay):
    """AdamW over the adapter parameters: weight decay on matrices only, not on 1-D params or biases."""
    decay, no_decay = {}, {}
    for name, p in model.adapter_parameters().items():
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay)[name] = p
    groups = [{"names": list(g), "params": list(g.values()), "weight_decay": wd}
              for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
    return AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


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
            loss, _ = model(jt.array(tokens), jt.array(mask))
            n = float(mask[:, 1:].sum())
            nll_sum += loss.item() * n
            count += n
    model.train()
    nll_sum, count = all_reduce_sum([nll_sum, count])
    return float(nll_sum / max(count, 1.0))


# ---- checkpoints -----------------------------------------------------------------

def rng_state():
    keys, pos, has_gauss, cached = np.random.get_state()[1:]
    numpy_state = {"keys": keys.astype(np.int64), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return {"numpy": numpy_state, "python": np.asarray(random.getstate()[1], dtype=np.int64)}


def set_rng_state(state):
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    random.setstate((3, tuple(int(x) for x in state["python"]), None))


def checkpoint_state(run, model, optimizer, epoch, data_iter_step):
    """Everything a resume needs; call on EVERY rank (it fetches Vars), then write on rank 0."""
    return {"adapter": adapter_arrays(model), "optimizer": optimizer.state_arrays(),
            "epoch": epoch, "data_iter_step": data_iter_step, "global_step": run.global_step,
            "early_stopper": run.stopper.state_dict(), "rng": rng_state(),
            "args": run.saved_args, "signature": run.signature, "model_args": model.args.to_dict()}


def write_checkpoint(state, path):
    """Rank 0 writes atomically (temp file + os.replace): a kill mid-write keeps the old file."""
    save_on_master(lambda tmp: save_pth(state, tmp), path)


def write_adapter(state, out_dir):
    """adapter.pth + adapter_params.json from a checkpoint state, as Models.checkpoints.save_adapter writes them."""
    if not is_main_process():
        return
    os.makedirs(out_dir, exist_ok=True)
    save_pth(state["adapter"], os.path.join(out_dir, ADAPTER_WEIGHTS))
    def write_json(tmp):
        with open(tmp, "w") as f:
            json.dump(state["model_args"], f, indent=2)
    save_on_master(write_json, os.path.join(out_dir, ADAPTER_PARAMS))


def log_line(run, record):
    """One JSON line in <output_dir>/log.txt (rank 0)."""
    if is_main_process():
        with open(os.path.join(run.output_dir, "log.txt"), "a") as f:
            f.write(json.dumps(record) + "\n")


# ---- training --------------------------------------------------------------------

class StopFlag:
    """SIGTERM, polled between optimizer steps; the loop then saves and leaves.

    Math.py blocks SIGTERM in every thread (Utils.jittor_env.block_sigterm), so it
    waits as pending until polled here and never interrupts Jittor. Where SIGTERM is
    not blocked (Math.main called in-process) it keeps its default action.
    """

    def __init__(self):
        self.requested = False

    def poll(self) -> bool:
        if not self.requested and signal.SIGTERM in signal.sigpending():
            signal.sigtimedwait([signal.SIGTERM], 0)  # consume it
            self.requested = True
        return self.requested


def validate_and_save(run, model, optimizer, epoch, next_step):
    """Validation (when there is a val set), early stopper, checkpoint-best and checkpoint-latest."""
    improved = False
    if run.val_dataset is not None:
        with jt.flag_scope(auto_mixed_precision_level=run.amp_level):
            val_loss = evaluate(model, run.val_dataset)
        improved, should_stop = run.stopper.step(val_loss)
        print(f"[val] step {run.global_step}: val_loss {val_loss:.4f} (best {run.stopper.best:.4f})"
              f"{' improved' if improved else ''}")
        if run.log_writer is not None:
            run.log_writer.add_scalar("val_loss", val_loss, run.global_step)
        log_line(run, {"event": "val", "step": run.global_step, "epoch": epoch, "val_loss": val_loss,
                       "best_val_loss": run.stopper.best})
        if should_stop:
            print(f"[early stop] no improvement in {run.stopper.patience} validations; best {run.stopper.best:.4f}")
            run.stop_reason = "early_stop"
    state = checkpoint_state(run, model, optimizer, epoch, next_step)
    if improved:
        write_checkpoint(state, os.path.join(run.output_dir, "checkpoint-best.pth"))
        write_adapter(state, os.path.join(run.output_dir, "adapter-best"))
    write_checkpoint(state, os.path.join(run.output_dir, "checkpoint-latest.pth"))


def train_one_epoch(model, dataset, optimizer, epoch, start_step, run, args):
    """Optimizer steps of `epoch` from global batch `start_step` (a multiple of accum_iter).

    Sets run.stop_reason to 'max_steps', 'sigterm' or 'early_stop' when the run must end early.
    """
    world = run.world_size
    first, last = start_step // args.accum_iter, run.steps_per_epoch
    metric_logger = MetricLogger(delimiter="  ")
    metric_logger.add_meter("lr", SmoothedValue(window_size=1, fmt="{value:.3e}"))
    header = f"Epoch: [{epoch}]"
    for opt_step in metric_logger.log_every(range(first, last), args.log_interval, header, total=last - first):
        started = time.time()
        batch_steps = range(opt_step * args.accum_iter, (opt_step + 1) * args.accum_iter)
        n_targets = sum(target_count(dataset, epoch, s) for s in batch_steps)
        lr = lr_at(run.global_step, run.total_steps, run.warmup_steps, args.lr, args.min_lr)
        optimizer.lr = lr
        for pg in optimizer.param_groups:
            pg["lr"] = lr

        local_nll, local_targets, input_tokens = 0.0, 0.0, 0
        for tokens, mask in itertools.islice(dataset.batches(epoch, batch_steps[0]), args.accum_iter):
            count = float(mask[:, 1:].sum())
            with jt.flag_scope(auto_mixed_precision_level=run.amp_level):
                loss, _ = model(jt.array(tokens), jt.array(mask))
                # local share of sum(mask*nll)/N; backward's rank mean then gives the global gradient
                optimizer.backward(loss * (count * world / max(n_targets, 1.0)))
            jt.sync([loss] + [g for pg in optimizer.param_groups for g in pg["grads"]])
            local_nll += loss.item() * count
            local_targets += count
            input_tokens += tokens.size
        nll_sum, targets, input_tokens, stop_votes = all_reduce_sum(
            [local_nll, local_targets, input_tokens, float(run.sigterm.poll())])
        train_loss = float(nll_sum / max(targets, 1.0))
        if not math.isfinite(train_loss):
            raise NonFiniteLoss(f"training loss is {train_loss} at step {run.global_step + 1} (epoch {epoch}); "
                                f"stopping without saving, the last good checkpoint is untouched. "
                                f"Try a lower --blr/--lr or --clip_grad")
        grad_norm = clip_gradients(optimizer, args.clip_grad)
        optimizer.step()
        jt.sync(list(model.adapter_parameters().values()) + [grad_norm])
        grad_norm = grad_norm.item()
        run.global_step += 1
        run.input_tokens += int(input_tokens)
        run.train_seconds += time.time() - started

        metric_logger.update(loss=train_loss, lr=lr, grad_norm=grad_norm)
        if run.log_writer is not None:
            run.log_writer.add_scalar("c_train_loss", train_loss, run.global_step)
            run.log_writer.add_scalar("lr", lr, run.global_step)
        if run.global_step % args.log_interval == 0 or run.global_step == 1:
            log_line(run, {"event": "train", "step": run.global_step, "epoch": epoch, "train_loss": train_loss,
                           "lr": lr, "grad_norm": grad_norm, "tokens": int(input_tokens)})

        next_step = (opt_step + 1) * args.accum_iter  # the global batch a resume starts from
        saved = opt_step + 1 == last or (args.eval_interval > 0 and run.global_step % args.eval_interval == 0)
        if saved:
            validate_and_save(run, model, optimizer, epoch, next_step)
        if stop_votes > 0:  # summed over ranks, so every rank stops at the same step
            run.stop_reason = "sigterm"
        elif args.max_steps and run.global_step >= args.max_steps and run.stop_reason is None:
            run.stop_reason = "max_steps"
        if run.stop_reason is not None:
            if not saved:
                write_checkpoint(checkpoint_state(run, model, optimizer, epoch, next_step),
                                 os.path.join(run.output_dir, "checkpoint-latest.pth"))
            break
    metric_logger.synchronize_between_processes()
    print(f"{header} averaged stats: {metric_logger}")
