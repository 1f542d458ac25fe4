"""Plain LoRA with Hugging Face peft on transformers, on the CPU: the peer of `bench.py --preset lora`.

    $REFVENV/bin/python bench/peft_bench.py --config small|medium [--precision fp32|bf16]

It runs in the reference venv (torch, transformers, peft: ../shared/ref/README.md), not in ours;
bench/side_by_side.py --against peft runs it beside bench.py. Torch uses 2 threads, as ref_bench.py.
Model: a LlamaForCausalLM of bench.py's shape (bench/common.py, random init, untied output, no
biases), peft LoRA on --lora_targets (our names, mapped to q_proj ... down_proj), rank and alpha as
given, no dropout; the base frozen by peft.
Training: new random tokens [8, 256] every step; forward with labels (transformers' mean
cross-entropy over the 8 x 255 shifted targets, no KV cache) + backward + torch AdamW over the
LoRA parameters (bench/common.py's lr and decay, betas 0.9, 0.95 as ours); the median of 5 steps
after 2 warm-ups. The first warm-up checks the loss against a cross-entropy of its logits over
loss_tokens targets.
Decoding: model.generate, greedy, its KV cache, no EOS so every row makes 64 tokens, batch 4 x
32-token prompts; tokens/s over the whole call, prefill included, as bench.py counts; the median
of 3 runs after one warm-up.
bf16 (the authors' bf16 mode as ref_bench.py moves it to the CPU): the base built and stored in
bf16, the LoRA weights in fp32 (peft's autocast_adapter_dtype), forward and generation under
torch.autocast('cpu', bf16); no gradient scaler (bf16 needs none, nor does transformers' Trainer).
The last line is key=value, with bench.py's keys.
"""
import argparse
import contextlib
import resource
import statistics
import time

from common import (CONFIGS, DECODE_BATCH, DECODE_RUNS, LR, NEW_TOKENS, PROMPT_LEN, TIMED_STEPS,  # bench/common.py
                    TRAIN_BATCH, TRAIN_SEQ, WARMUP_STEPS, WEIGHT_DECAY, describe_optimizer, fail)

HF_NAMES = {"Q": "q_proj", "K": "k_proj", "V": "v_proj", "O": "o_proj", "FFN_UP": "up_proj",
            "FFN_GATE": "gate_proj", "FFN_DOWN": "down_proj"}
BETAS = (0.9, 0.95)  # Models/kernels/adamw.build_optimizer's; side_by_side.py compares the two descriptions


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model size")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--lora_rank", type=int, default=8, help="LoRA rank r (the bench recipe's: 8)")
    parser.add_argument("--lora_alpha", type=float, default=8.0, help="LoRA scale numerator (the bench recipe's: 8)")
    parser.add_argument("--lora_targets", default="Q,K,V,O,FFN_UP,FFN_DOWN",
                        help=f"comma list from {','.join(HF_NAMES)} (the bench recipe's: Q,K,V,O,FFN_UP,FFN_DOWN)")
    parser.error = fail  # the project's contract: one `error:` line, exit 2
    opts = parser.parse_args()
    targets = [t.strip() for t in opts.lora_targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in HF_NAMES]
    if unknown or not targets or len(set(targets)) < len(targets):
        fail(f"--lora_targets {opts.lora_targets!r}: give distinct targets from {','.join(HF_NAMES)}")
    if opts.lora_rank < 1 or not opts.lora_alpha > 0:
        fail(f"--lora_rank must be at least 1 and --lora_alpha > 0; got {opts.lora_rank}, {opts.lora_alpha}")
    opts.targets = targets
    return opts


def ffn_hidden_dim(dim: int, multiple_of: int) -> int:
    """LLaMA's FFN width, as Models/ModelArgs.ffn_hidden_dim (side_by_side.py checks equal base sizes)."""
    hidden = int(2 * 4 * dim / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def build(opts, torch, transformers, peft):
    shape = CONFIGS[opts.config]
    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["dim"], num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
        intermediate_size=ffn_hidden_dim(shape["dim"], shape["multiple_of"]), max_position_embeddings=TRAIN_SEQ,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False)
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    base = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)  # no fp32 copy on the way to bf16
    base.generation_config.eos_token_id = None  # every row makes NEW_TOKENS, as bench.py's no stop tokens
    base.generation_config.pad_token_id = 0
    lora = peft.LoraConfig(r=opts.lora_rank, lora_alpha=opts.lora_alpha, lora_dropout=0.0, bias="none",
                           target_modules=[HF_NAMES[t] for t in opts.targets], task_type="CAUSAL_LM")
    return peft.get_peft_model(base, lora)  # autocast_adapter_dtype: fp32 LoRA over a bf16 base


def time_training(model, opts, torch, amp):
    """(first step s, median step s, the optimizer's description, the loss's target tokens per step)."""
    vocab = model.config.vocab_size
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    groups = [(sum(p.numel() for p in g["params"]), g["lr"], g["betas"], g["eps"], g["weight_decay"])
              for g in optimizer.param_groups]
    generator = torch.Generator().manual_seed(0)
    model.train()
    times, loss_tokens = [], None
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        tokens = torch.randint(0, vocab, (TRAIN_BATCH, TRAIN_SEQ), generator=generator)
        start = time.perf_counter()
        with amp():
            out = model(input_ids=tokens, labels=tokens, use_cache=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if step == 0:  # what transformers' loss averaged over: tokens[:, 1:] predicted from the prefix
            targets = tokens[:, 1:]
            loss_tokens = int((targets != -100).sum())
            with torch.no_grad():  # row by row: no [B, T, V] copy to raise the peak RSS
                ours = sum(torch.nn.functional.cross_entropy(out.logits[row, :-1].float(), targets[row],
                                                             reduction="sum") for row in range(TRAIN_BATCH))
                ours = ours / loss_tokens
            if abs(float(ours) - out.loss.item()) > 1e-3 * abs(float(ours)):
                raise SystemExit(f"error: transformers' loss {out.loss.item():.5f} is not the mean over "
                                 f"{loss_tokens} targets ({float(ours):.5f})")
        del out
    return times[0], statistics.median(times[WARMUP_STEPS:]), describe_optimizer("AdamW", groups), loss_tokens


def time_decoding(model, torch, amp):
    """(tokens/s over the whole generate call, prefill included, tokens made per call)."""
    model.eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, model.config.vocab_size, (DECODE_BATCH, PROMPT_LEN), generator=generator)
    mask = torch.ones_like(prompts)
    rates = []
    for run in range(1 + DECODE_RUNS):  # one warm-up
        start = time.perf_counter()
        with torch.no_grad(), amp():
            out = model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 do_sample=False, use_cache=True)
        elapsed = time.perf_counter() - start
        made = out[:, PROMPT_LEN:].numel()
        if made != DECODE_BATCH * NEW_TOKENS:
            raise SystemExit(f"error: generate made {made} tokens, expected {DECODE_BATCH * NEW_TOKENS}")
        if run:
            rates.append(made / elapsed)
    return statistics.median(rates), made


def main():
    opts = parse_args()
    import torch  # after the arguments: a bad flag is refused without loading torch
    import transformers
    import peft

    torch.set_num_threads(2)
    torch.manual_seed(0)
    bf16 = opts.precision == "bf16"
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    model = build(opts, torch, transformers, peft)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    dtypes = sorted({f"{str(p.dtype)[6:]}/{'lora' if p.requires_grad else 'base'}" for p in model.parameters()})
    print(f"[setup] torch={torch.__version__} transformers={transformers.__version__} peft={peft.__version__} "
          f"threads={torch.get_num_threads()} attention={model.config._attn_implementation} dtypes={','.join(dtypes)}",
          flush=True)
    first_step_s, train_s, optimizer, loss_tokens = time_training(model, opts, torch, amp)
    decode_tok_s, decode_tokens = time_decoding(model, torch, amp)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"method=lora config={opts.config} precision={opts.precision} train_ms={train_s * 1e3:.1f} "
          f"train_tok_s={TRAIN_BATCH * TRAIN_SEQ / train_s:.0f} decode_tok_s={decode_tok_s:.0f} "
          f"peak_rss_mb={peak_rss_mb:.0f} first_step_s={first_step_s:.2f} warm_step_s={train_s:.3f} "
          f"trainable_params={trainable} base_params={frozen} train_tokens={TRAIN_BATCH * TRAIN_SEQ} "
          f"loss_tokens={loss_tokens} decode_tokens={decode_tokens} optimizer={optimizer} "
          f"lora_rank={opts.lora_rank} lora_alpha={opts.lora_alpha:g} lora_targets={','.join(opts.targets)}")


if __name__ == "__main__":
    main()
